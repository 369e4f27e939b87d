"""Strata's benchmarks: `python -m benchmarks [suite ...]` runs the suites in benchmarks/suites/."""
