"""The suffix-over-prefix attention: the same numbers as transformers' sdpa, without repeat_kv."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from worker.dataplane.models.loading import load_model
from worker.dataplane.prefix import attention


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


@pytest.mark.parametrize(
    ("queries", "prefix", "heads", "kv_heads", "dtype"),
    [
        (1100, 300, 8, 2, torch.float32),  # a long suffix over a short prefix, grouped-query
        (130, 8192, 16, 4, torch.float32),  # a short suffix over a long prefix
        (1024, 1024, 4, 4, torch.float32),  # one KV head per query head
        (1100, 300, 8, 2, torch.bfloat16),
    ],
)
def test_a_long_suffix_over_a_prefix_splits_and_matches_transformers_sdpa(
    monkeypatch, queries: int, prefix: int, heads: int, kv_heads: int, dtype: torch.dtype
) -> None:
    split = []
    real = attention.prefix_then_causal
    monkeypatch.setattr(attention, "prefix_then_causal", lambda *a: split.append(1) or real(*a))
    module, query, key, value, mask = _inputs(queries, prefix, heads=heads, kv_heads=kv_heads)
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    ours, _ = attention.strata_sdpa_forward(module, query, key, value, mask, scaling=0.2)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.2)
    assert split == [1]
    assert ours.shape == theirs.shape == (1, queries, heads, 32)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(ours, theirs, **tolerance)


def test_any_other_mask_keeps_the_masked_kernel(monkeypatch) -> None:
    # One key hidden from one query: not the plain suffix mask, so no split; still exact. A new
    # mask tensor is checked afresh even where the previous one was the plain mask.
    split = []
    real = attention.prefix_then_causal
    monkeypatch.setattr(attention, "prefix_then_causal", lambda *a: split.append(1) or real(*a))
    module, query, key, value, mask = _inputs(1100, 300)
    attention.strata_sdpa_forward(module, query, key, value, mask, scaling=0.2)
    assert split == [1]
    holed = mask.clone()
    holed[0, 0, 500, 17] = False
    ours, _ = attention.strata_sdpa_forward(module, query, key, value, holed, scaling=0.2)
    theirs, _ = sdpa_attention_forward(module, query, key, value, holed, scaling=0.2)
    assert split == [1]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
