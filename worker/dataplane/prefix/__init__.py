"""A stored prefix inside a model: the transformers Cache whose layers start from a loaded prefix,
each waiting only for its own layer's load (cache.py), and the attention of a suffix over that
prefix (attention.py).

Strata's engine, fragment reuse (`blend`), the layer loader and the vLLM connector all meet a
loaded prefix here, so it sits below all of them and imports only torch and transformers."""
