"""Strata inside other engines: connectors that give an engine's KV cache our tiers, through the one offload manager."""
