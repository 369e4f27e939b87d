"""Fusion: blend at r = 100% is a full prefill; lower r computes fewer tokens; prefix reuse stays exact."""

from __future__ import annotations

import math

import pytest
import torch

from tests.blend.conftest import BLOCK_TOKENS, blend_engine, tokens
from worker.dataplane.blend.matching import fragment_key
from worker.dataplane.hashing import content_key


def rag_setup(engine, *, seed: int) -> tuple[list[int], list]:
    """Store three passages through earlier requests, then return a prompt holding them in another
    order after a shared prefix, and the keys of every block those requests stored."""
    header = tokens(2 * BLOCK_TOKENS - 1, seed=seed)
    passages = [tokens(2 * BLOCK_TOKENS, seed=seed + i + 1) for i in range(3)]
    stored = []
    fp = engine.fingerprinter("default")
    for i, passage in enumerate(passages):
        prompt = [1, *header, *tokens(3 + i, seed=seed + 10 + i), *passage, 2]
        start = 2 * BLOCK_TOKENS + 3 + i
        engine.generate(prompt, max_tokens=1, segments=[[start, start + len(passage)]])
        stored += [p.prefix_key for p in fp.blocks(prompt)]
        for offset in (start, start + BLOCK_TOKENS):
            key = content_key(
                ns_salt=fp.ns_salt, model_key=fp.model_key, token_ids=prompt[offset : offset + BLOCK_TOKENS]
            )
            stored.append(fragment_key(ns_salt=fp.ns_salt, model_key=fp.model_key, content_key=key, position=offset))
    prompt = [
        1,
        *header,
        *passages[2],
        *tokens(5, seed=seed + 20),
        *passages[0],
        *passages[1],
        *tokens(6, seed=seed + 21),
    ]
    return prompt, stored


@pytest.mark.parametrize(
    ("family", "dtype"),
    [("tiny", "float32"), ("tiny-qwen2", "float32"), ("tiny-mistral", "float32"), ("tiny", "bfloat16")],
)
def test_full_recompute_equals_full_prefill(models, family, dtype):
    model = models(family, dtype)
    engine = blend_engine(model, recompute_percent=100)
    prompt, _ = rag_setup(engine, seed=100)
    blended = engine.generate(prompt, max_tokens=8, write_back=False)
    full = engine.generate(prompt, max_tokens=8, use_cache=False)
    trace = blended.trace
    assert trace.prefix_tokens == 2 * BLOCK_TOKENS
    assert trace.fragment_tokens == 6 * BLOCK_TOKENS and trace.recomputed_tokens == 6 * BLOCK_TOKENS
    assert trace.recompute_ratio == 1.0
    tolerance = 1e-4 if dtype == "float32" else 3e-2
    torch.testing.assert_close(blended.first_logits, full.first_logits, rtol=tolerance, atol=tolerance)
    assert blended.output_ids == full.output_ids


@pytest.mark.parametrize("selection", ["deviation", "chunk-start"])
def test_lower_ratios_recompute_fewer_tokens(models, selection):
    model = models("tiny")
    engine = blend_engine(model, recompute_percent=15, selection=selection)
    prompt, _ = rag_setup(engine, seed=200)
    kl = {}
    full = engine.generate(prompt, max_tokens=1, use_cache=False)
    for percent in (0, 15, 50, 100):
        engine.tuner.set_percent("default", percent)
        result = engine.generate(prompt, max_tokens=1, write_back=False)
        fragment = result.trace.fragment_tokens
        assert fragment == 6 * BLOCK_TOKENS
        # deviation: r% of all fragment tokens; chunk-start: r% of each reused block, from its start.
        expected = (
            math.ceil(percent / 100 * fragment)
            if selection == "deviation"
            else 6 * math.ceil(percent / 100 * BLOCK_TOKENS)
        )
        assert result.trace.recomputed_tokens == expected
        assert result.trace.cached_tokens == result.trace.prefix_tokens + fragment - expected
        full_logp = torch.log_softmax(full.first_logits, -1)
        kl[percent] = float(torch.sum(full_logp.exp() * (full_logp - torch.log_softmax(result.first_logits, -1))))
    assert kl[100] < 1e-6
    assert kl[0] > kl[100]


def test_blended_bytes_never_serve_a_prefix_hit(models):
    """Blocks after the first fused fragment are approximate: they are kept under fragment keys
    only, so an identical prompt later is still exact wherever it hits by prefix."""
    model = models("tiny")
    engine = blend_engine(model, recompute_percent=0)
    prompt, _ = rag_setup(engine, seed=300)
    cold = engine.generate(prompt, max_tokens=10, use_cache=False)
    blended = engine.generate(prompt, max_tokens=10)
    assert blended.trace.fragment_tokens > 0
    again = engine.generate(prompt, max_tokens=10, blend=False)
    assert again.trace.prefix_tokens == 2 * BLOCK_TOKENS  # only the exact header, not the fused part
    assert again.output_ids == cold.output_ids


def test_prefix_hits_with_blend_on_are_token_identical_to_cold(models):
    model = models("tiny")
    engine = blend_engine(model)
    prompt = [1, *tokens(150, seed=400)]
    cold = engine.generate(prompt, max_tokens=12, use_cache=False)
    engine.generate(prompt, max_tokens=12)
    warm = engine.generate(prompt, max_tokens=12)
    assert warm.trace.prefix_tokens == (151 // BLOCK_TOKENS) * BLOCK_TOKENS
    assert warm.trace.fragment_tokens == 0 and warm.trace.blend == "no-fragment"
    assert warm.output_ids == cold.output_ids


def test_a_vanished_fragment_is_a_miss(models):
    model = models("tiny")
    engine = blend_engine(model, recompute_percent=0)
    prompt, stored = rag_setup(engine, seed=500)
    cold = engine.generate(prompt, max_tokens=6, use_cache=False)
    found = engine.generate(prompt, max_tokens=1, write_back=False)
    assert found.trace.fragment_tokens == 6 * BLOCK_TOKENS
    prompt_blocks = {p.prefix_key for p in engine.fingerprinter("default").blocks(prompt)}
    device = engine.store.tier("device")
    for key in stored:
        if key not in prompt_blocks:  # keep the shared header: its prefix hit stays
            device.delete(key)
    result = engine.generate(prompt, max_tokens=6)
    assert result.trace.fragment_tokens == 0 and result.trace.blend == "no-fragment"
    assert result.trace.prefix_tokens == 2 * BLOCK_TOKENS
    assert result.output_ids == cold.output_ids


@pytest.mark.parametrize("gqa", [True, False])
def test_row_chunked_attention_equals_one_masked_call(gqa: bool) -> None:
    import torch.nn.functional as F  # noqa: PLC0415

    from worker.dataplane.blend import fusion  # noqa: PLC0415

    generator = torch.Generator().manual_seed(5)
    n, heads, kv_heads = 1000, 8, 2 if gqa else 8
    positions = torch.sort(torch.randperm(n - 40, generator=generator)[:300] + 40).values
    q = torch.randn(1, heads, positions.numel(), 16, generator=generator)
    keys = torch.randn(1, kv_heads, n, 16, generator=generator)
    values = torch.randn(1, kv_heads, n, 16, generator=generator)
    key_positions = torch.arange(n)
    chunks = fusion._row_chunks(positions, key_positions, q.dtype)
    ours = fusion._attend_in_row_chunks(q, keys, values, chunks, 0.25, gqa)
    mask = key_positions.unsqueeze(0) <= positions.unsqueeze(1)
    expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=0.25, enable_gqa=gqa)
    assert positions.numel() > 2 * fusion.ROW_CHUNK  # several chunks, the last one partial
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
