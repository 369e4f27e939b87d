"""The inference engine: transformers models with cache-aware prefill and layer-wise loading."""
