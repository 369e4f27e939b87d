"""Entry point of `python -m benchmarks`."""

from benchmarks.harness import main

raise SystemExit(main())
