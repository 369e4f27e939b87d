"""Strata's own inference engine: one request's path from lookup to write-back (engine.py), the
turns prefill, decode and write-back take at the model (turns.py), the device working set
(working_set.py) and the write-back of new blocks (write_back.py). Its HTTP face is `serving`,
its models `models`; the loaded prefix it shares with fragment reuse and the vLLM connector is
`prefix`, its layer-wise loader `layer_loader`."""
