"""The suffix-over-prefix attention: the same numbers as transformers' sdpa, without repeat_kv."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from worker.dataplane.engine import attention
from worker.dataplane.engine.models import load_model


def _inputs(queries: int, prefix: int, *, heads: int = 8, kv_heads: int = 2, dim: int = 32):
    generator = torch.Generator().manual_seed(queries * 1000 + prefix)
    query = torch.randn(1, heads, queries, dim, generator=generator)
    key = torch.randn(1, kv_heads, prefix + queries, dim, generator=generator)
    value = torch.randn(1, kv_heads, prefix + queries, dim, generator=generator)
    # The suffix's causal mask over the cached prefix: query i sees the prefix and suffix tokens <= i.
    mask = (torch.arange(queries)[:, None] + prefix >= torch.arange(prefix + queries)[None, :]).view(
        1, 1, queries, prefix + queries
    )
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)
    return module, query, key, value, mask


@pytest.mark.parametrize("queries", [2, 7, 64])
def test_masked_gqa_matches_transformers_sdpa(queries: int) -> None:
    module, query, key, value, mask = _inputs(queries, prefix=300)
    ours, _ = attention.strata_sdpa_forward(module, query, key, value, mask, scaling=0.2)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.2)
    assert ours.shape == theirs.shape == (1, queries, 8, 32)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_unmasked_and_single_query_calls_go_to_transformers(monkeypatch) -> None:
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[4])
        return sdpa_attention_forward(*args, **kwargs)

    monkeypatch.setattr(attention, "sdpa_attention_forward", spy)
    module, query, key, value, mask = _inputs(1, prefix=40)
    attention.strata_sdpa_forward(module, query, key, value, mask)
    module, query, key, value, _mask = _inputs(5, prefix=0)
    attention.strata_sdpa_forward(module, query, key, value, None)
    assert len(calls) == 2


def test_models_load_with_the_strata_attention() -> None:
    model = load_model("tiny", dtype="float32")
    assert model.model.config._attn_implementation == attention.NAME
