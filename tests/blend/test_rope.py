"""RoPE re-alignment: a cached key rotated by the position difference is the key computed at the new position."""

from __future__ import annotations

import pytest
import torch

from tests.blend.conftest import BLOCK_TOKENS, blend_engine, tokens
from worker.dataplane.blend.rope import rerotate, rope_problem


def keys_at(model, ids: list[int], positions: torch.Tensor) -> torch.Tensor:
    """Layer-0 keys of `ids` placed at `positions`, as the model computes them ([1, kv_heads, n, head_dim])."""
    base = model.model.model
    attn = base.layers[0].self_attn
    x = base.layers[0].input_layernorm(base.embed_tokens(torch.tensor([ids])))
    k = attn.k_proj(x).view(1, len(ids), -1, attn.head_dim).transpose(1, 2)
    cos, sin = base.rotary_emb(x, position_ids=positions.unsqueeze(0))
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = k.shape[-1] // 2
    return k * cos + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin


@pytest.mark.parametrize("family", ["tiny", "tiny-qwen2", "tiny-mistral"])
@pytest.mark.parametrize("shift", [37, -5, 1000])
def test_rerotated_keys_equal_keys_computed_at_the_new_position(models, family, shift):
    model = models(family)
    ids = tokens(24, seed=1)
    old = torch.arange(10, 34)
    with torch.inference_mode():
        cached = keys_at(model, ids, old)
        fresh = keys_at(model, ids, old + shift)
        moved = rerotate(cached, torch.full((24,), shift), model.model.model.rotary_emb)
    assert not torch.allclose(cached, fresh, atol=1e-3)  # the positions really differ
    torch.testing.assert_close(moved, fresh, rtol=1e-5, atol=1e-5)


def test_rerotation_in_bfloat16_stays_within_its_precision(models):
    model = models("tiny", "bfloat16")
    ids = tokens(24, seed=2)
    with torch.inference_mode():
        cached = keys_at(model, ids, torch.arange(24))
        fresh = keys_at(model, ids, torch.arange(24) + 300)
        moved = rerotate(cached, torch.full((24,), 300), model.model.model.rotary_emb)
    torch.testing.assert_close(moved.float(), fresh.float(), rtol=2e-2, atol=2e-2)


def test_per_token_shifts(models):
    model = models("tiny")
    ids = tokens(8, seed=3)
    old = torch.tensor([0, 1, 2, 3, 50, 51, 52, 53])
    new = torch.tensor([100, 101, 102, 103, 7, 8, 9, 10])
    with torch.inference_mode():
        moved = rerotate(keys_at(model, ids, old), new - old, model.model.model.rotary_emb)
        torch.testing.assert_close(moved, keys_at(model, ids, new), rtol=1e-5, atol=1e-5)


def test_fused_cache_holds_the_keys_of_the_new_positions(models):
    """End to end: a fragment stored at one position and reused at another carries, in the
    request's KV cache, exactly the first-layer keys a full prefill computes there."""
    model = models("tiny")
    engine = blend_engine(model, recompute_percent=0, selection="chunk-start")
    passage = tokens(2 * BLOCK_TOKENS, seed=4)
    engine.generate([1, *tokens(5, seed=5), *passage, 7], max_tokens=1, segments=[[6, 6 + len(passage)]])
    prompt = [1, *tokens(41, seed=6), *passage, *tokens(9, seed=7)]
    result = engine.generate(prompt, max_tokens=1, write_back=False, keep_cache=True)
    assert result.trace.fragment_tokens == 2 * BLOCK_TOKENS and result.trace.recomputed_tokens == 0
    with torch.inference_mode():
        expected = keys_at(model, prompt, torch.arange(len(prompt)))
    fused = result.cache.layer_kv(0)[0]
    torch.testing.assert_close(
        fused[:, :, 42 : 42 + len(passage)], expected[:, :, 42 : 42 + len(passage)], rtol=1e-5, atol=1e-5
    )


def test_rope_variants_that_cannot_be_realigned_are_named(models):
    rotary = models("tiny").model.model.rotary_emb
    assert rope_problem(rotary) is None

    class Dynamic:
        rope_type = "dynamic"
        attention_scaling = 1.0

    assert "changes its frequencies" in rope_problem(Dynamic())
