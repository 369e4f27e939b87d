"""Stand-alone benchmark runs outside the harness, each run as `python -m benchmarks.scripts.<name>`
from the repository root (the GPU side-by-side of vLLM's offloading connectors)."""
