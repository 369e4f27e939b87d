"""The models Strata's engine serves and the vLLM connector profiles: presets with random weights
and checkpoints loaded through transformers (loading.py), checkpoint resolution and content digests
(checkpoints.py) and the byte-level tokenizer of the presets (tokenizer.py)."""
