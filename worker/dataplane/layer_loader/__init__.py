"""The layer-wise loader (loader.py): a prompt's hit blocks read from the tiers layer by layer while
the model computes, each layer's gate (`prefix.cache.LayerGate`) opened once its part is in place.

A room of its own below Strata's engine, above the tiers and `prefix`: it imports no engine, no
connector and no fragment reuse, so anything that loads a prefix layer by layer can use it."""
