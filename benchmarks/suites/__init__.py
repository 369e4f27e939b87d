"""Benchmark suites. Each module here is a suite named after the module: it exposes
`run(ctx: benchmarks.harness.Context) -> list[benchmarks.harness.Row]` and may set
`DESCRIPTION`. Add a suite by dropping a module in; the harness finds it."""
