"""The small models the `blend` suite measures quality on, trained here from fixed seeds: the
lookup task (`blend`, which also reports the quality of both tasks), the multi-hop task
(`multihop`), and what their training shares (`training`)."""
