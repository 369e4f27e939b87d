"""Selective recompute (CacheBlend): prefill a prompt whose middle comes from cached fragments.

Reused fragments were computed in another context, so their KV lacks the attention to what now
precedes them. Recomputing everything would waste the cache; recomputing nothing lets those
errors reach the answer. CacheBlend's middle way, done here layer by layer over the model's own
modules:

- layers before the check layer are computed for every token (the first layer's KV of a
  fragment is exact once re-aligned, but its output feeds the deviation test);
- at the check layer the fresh K/V of every reused token is compared with its re-aligned cached
  K/V; the r% with the largest deviation are selected;
- from there on only the new tokens and the selected ones are computed; every other reused
  token keeps its cached (re-aligned) KV, which the computed tokens attend to.

`chunk-start` selection (EPIC) picks the first r% tokens of every reused run instead and needs no
check layer, so even the first layers skip the other reused tokens.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from worker.dataplane.blend.matching import Fragment
from worker.dataplane.blend.rope import rotate_half, rotation
from worker.dataplane.prefix.attention import prefix_then_causal
from worker.dataplane.prefix.cache import StrataCache

LayerSource = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
"""Given a layer: that layer of the loaded prefix blocks and of the fragments' blocks, as stored
(`[blocks, 2 (K, V), block_tokens, kv_heads, head_dim]`, fragments in prompt order, not yet
re-aligned). It waits for that layer's load (the sync point) and raises LoadFailed if it failed."""


@dataclasses.dataclass(frozen=True)
class BlendPlan:
    prefix_len: int
    fragments: Sequence[Fragment]
    """Sorted by start, inside [prefix_len, len(prompt) - 1)."""
    recompute_ratio: float
    """r as a fraction, 0..1."""
    selection: str = "deviation"
    check_layer: int = 1


@dataclasses.dataclass
class BlendOutcome:
    cache: StrataCache
    logits: torch.Tensor
    """Logits of the last prompt position."""
    reused_tokens: int
    """Fragment tokens whose cached KV was kept (not recomputed)."""
    recomputed_tokens: int
    """Fragment tokens recomputed (selected by deviation or chunk start)."""
    computed_tokens_per_layer: list[int]


def _chunk_start_selection(plan: BlendPlan, rel_start: int) -> list[int]:
    chosen: list[int] = []
    for fragment in plan.fragments:
        count = math.ceil(plan.recompute_ratio * fragment.tokens)
        base = fragment.start - rel_start
        chosen.extend(range(base, base + count))
    return chosen


ROW_CHUNK = 128
"""Computed rows attended to per masked kernel call on CPU (see `_attend_in_row_chunks`)."""


RowChunks = list[tuple[int, int, torch.Tensor]]
"""(first row, keys seen, additive mask [rows, keys seen]) of each chunk of computed rows."""


def _row_chunks(positions: torch.Tensor, key_positions: torch.Tensor, dtype: torch.dtype) -> RowChunks:
    """The chunks `_attend_in_row_chunks` runs, with their masks: built once for every layer
    that computes the same rows (all those after the check layer)."""
    chunks = []
    for first in range(0, positions.numel(), ROW_CHUNK):
        rows = positions[first : first + ROW_CHUNK]
        seen = int(rows[-1]) + 1
        hidden = key_positions[:seen].unsqueeze(0) > rows.unsqueeze(1)
        chunks.append(
            (
                first,
                seen,
                torch.zeros(hidden.shape, dtype=dtype, device=rows.device).masked_fill_(hidden, float("-inf")),
            )
        )
    return chunks


def _attend_in_row_chunks(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, chunks: RowChunks, scale: float, gqa: bool
) -> torch.Tensor:
    """Attention of the computed rows (at ascending positions, scattered through the prompt)
    over every key at a position not after theirs, ROW_CHUNK rows at a time, each chunk over the
    keys up to its last row's position only: the masked kernel computes every score it is given,
    so leaving out the keys no row of a chunk may see does about half the work
    (benchmarks/README.md). Rows are independent: the
    result is the one-call result."""
    parts = []
    for first, seen, mask in chunks:
        parts.append(
            F.scaled_dot_product_attention(
                q[:, :, first : first + ROW_CHUNK],
                keys[:, :, :seen],
                values[:, :, :seen],
                attn_mask=mask,
                scale=scale,
                enable_gqa=gqa,
            )
        )
    return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]


Run = tuple[int, int, int, int]
"""(first prompt position, first fragment, fragments, first reused token) of adjacent fragments."""


def _runs(fragments: Sequence[Fragment]) -> list[Run]:
    runs: list[Run] = []
    row = end = 0
    for i, fragment in enumerate(fragments):
        if runs and end == fragment.start:
            start, first, count, first_row = runs[-1]
            runs[-1] = (start, first, count + 1, first_row)
        else:
            runs.append((fragment.start, i, 1, row))
        end = fragment.end
        row += fragment.tokens
    return runs


def _blocks_as_heads(blocks: torch.Tensor, part: int) -> torch.Tensor:
    """K (part 0) or V (1) of `[blocks, 2, T, kv_heads, D]` stored blocks as a `[kv_heads, blocks, T, D]` view."""
    return blocks[:, part].permute(2, 0, 1, 3)


def _place(
    full_k: torch.Tensor,
    full_v: torch.Tensor,
    prefix: torch.Tensor,
    fragments: torch.Tensor,
    runs: Sequence[Run],
    angles: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """Write the loaded KV into the layer's whole KV `[1, kv_heads, n, D]`: the prefix as it is,
    each run of adjacent fragments with its keys rotated to their new positions - straight from
    the stored blocks into place, no copy in between (fp32: the rotation writes its output there)."""
    heads, tokens, dim = full_k.shape[1], fragments.shape[2] if fragments.numel() else 0, full_k.shape[3]
    if prefix.shape[0]:
        count, size = prefix.shape[0], prefix.shape[2]
        full_k[0, :, : count * size].view(heads, count, size, dim).copy_(_blocks_as_heads(prefix, 0))
        full_v[0, :, : count * size].view(heads, count, size, dim).copy_(_blocks_as_heads(prefix, 1))
    if not runs:
        return
    assert angles is not None
    cos, sin = angles  # [1, 1, reused tokens, D], float32
    half = dim // 2
    for start, first, count, row in runs:
        end = start + count * tokens
        keys = _blocks_as_heads(fragments[first : first + count], 0)
        full_v[0, :, start:end].view(heads, count, tokens, dim).copy_(
            _blocks_as_heads(fragments[first : first + count], 1)
        )
        c = cos[0, 0, row : row + count * tokens].view(1, count, tokens, dim)
        s = sin[0, 0, row : row + count * tokens].view(1, count, tokens, dim)
        out = full_k[0, :, start:end].view(heads, count, tokens, dim)
        if out.dtype == torch.float32 and keys.dtype == torch.float32:
            # x * cos + rotate_half(x) * sin, half by half: (x1 c - x2 s, x2 c + x1 s).
            x1, x2 = keys[..., :half], keys[..., half:]
            torch.mul(x1, c[..., :half], out=out[..., :half]).addcmul_(x2, s[..., :half], value=-1)
            torch.mul(x2, c[..., half:], out=out[..., half:]).addcmul_(x1, s[..., half:])
        else:  # computed in float32 and rounded once, as `rope.rotate` does
            work = keys.to(torch.float32)
            out.copy_(work * c + rotate_half(work) * s)


def blend_prefill(
    model: Any, prompt: Sequence[int], plan: BlendPlan, source: LayerSource, *, device: torch.device
) -> BlendOutcome:
    """Prefill `prompt` with the prefix and the fragments taken from `source`, recomputing r% of
    the fragment tokens; returns the full KV of every layer (ready for decoding) and the logits."""
    base = model.model
    layers = base.layers
    n = len(prompt)
    P = plan.prefix_len
    span = n - P
    if span < 1:
        raise ValueError("prompt: the last token must be computed")
    reused = torch.zeros(span, dtype=torch.bool)
    shift = torch.zeros(span, dtype=torch.long)
    for fragment in plan.fragments:
        if fragment.start < P or fragment.end > n - 1:
            raise ValueError(f"fragment at {fragment.start}..{fragment.end} lies outside {P}..{n - 1}")
        reused[fragment.start - P : fragment.end - P] = True
        shift[fragment.start - P : fragment.end - P] = fragment.shift
    reused_idx = reused.nonzero().squeeze(1)
    fresh_idx = (~reused).nonzero().squeeze(1)
    m = int(reused_idx.numel())
    keep_count = min(m, math.ceil(plan.recompute_ratio * m - 1e-9))
    check_layer: int | None = plan.check_layer
    if plan.selection == "chunk-start" or keep_count >= m:
        selected = reused_idx if keep_count >= m else torch.tensor(_chunk_start_selection(plan, P), dtype=torch.long)
        computed = torch.sort(torch.cat([fresh_idx, selected])).values
        check_layer = None
        recomputed = int(selected.numel())
    else:
        computed = torch.arange(span)
        recomputed = 0
    reused_dev = reused_idx.to(device)
    reused_at = reused_dev + P  # positions in the prompt
    rotary = base.rotary_emb
    # The shift of every reused token is the same at every layer: one cos/sin for all of them.
    shift_angles = rotation(rotary, shift[reused_idx].to(device)) if m else None
    ids = torch.tensor(prompt, device=device)
    hidden = base.embed_tokens(ids[P:][computed.to(device)]).unsqueeze(0)
    # New tokens get RoPE exactly as the model applies it (in its dtype), so r = 100% is a full prefill.
    probe = torch.empty(0, dtype=hidden.dtype, device=device)
    key_positions = torch.arange(n, device=device)
    cache = StrataCache(layers=len(layers))
    per_layer: list[int] = []
    # Of the computed positions, reset when they change: their RoPE angles and attention masks.
    angles: tuple[torch.Tensor, torch.Tensor] | None = None
    chunks: RowChunks | None = None
    computed_dev = computed.to(device)
    runs = _runs(plan.fragments)
    for li, layer in enumerate(layers):
        prefix_blocks, fragment_blocks = source(li)
        if li == 0 and (
            fragment_blocks.shape[0] != len(plan.fragments)
            or any(f.tokens != fragment_blocks.shape[2] for f in plan.fragments)
        ):
            raise ValueError(
                f"the source holds {fragment_blocks.shape[0]} fragment blocks of {fragment_blocks.shape[2]} "
                f"tokens; the plan has {len(plan.fragments)} fragments, each a whole block"
            )
        if prefix_blocks.device != device:
            prefix_blocks = prefix_blocks.to(device, non_blocking=True)
            fragment_blocks = fragment_blocks.to(device, non_blocking=True)
        attn = layer.self_attn
        head_dim = attn.head_dim
        everything = int(computed_dev.numel()) == span
        x = layer.input_layernorm(hidden)
        c = x.shape[1]
        q = attn.q_proj(x).view(1, c, -1, head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(1, c, -1, head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(1, c, -1, head_dim).transpose(1, 2)
        positions = computed_dev + P
        if angles is None:
            cos, sin = rotary(probe, position_ids=positions.unsqueeze(0))
            angles = (cos.unsqueeze(1), sin.unsqueeze(1))
        cos, sin = angles
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        kv_heads = k.shape[1]
        # The layer's whole KV, prefix first: written in place (this is the cache kept for decoding).
        full_k = torch.empty(1, kv_heads, n, head_dim, dtype=k.dtype, device=device)
        full_v = torch.empty_like(full_k)
        _place(full_k, full_v, prefix_blocks, fragment_blocks, runs, shift_angles)
        if li == check_layer:
            # Every token was computed so far: rows of q/k/v/hidden are relative positions 0..span-1.
            deviation = ((k.index_select(2, reused_dev).float() - full_k.index_select(2, reused_at).float()) ** 2).sum(
                dim=(0, 1, 3)
            )
            deviation += ((v.index_select(2, reused_dev).float() - full_v.index_select(2, reused_at).float()) ** 2).sum(
                dim=(0, 1, 3)
            )
            top = torch.topk(deviation, keep_count).indices.cpu() if keep_count else torch.empty(0, dtype=torch.long)
            selected = reused_idx[top]
            recomputed = int(selected.numel())
            computed = torch.sort(torch.cat([fresh_idx, selected])).values
            rows = computed.to(device)
            hidden, q, k, v = hidden[:, rows], q[:, :, rows], k[:, :, rows], v[:, :, rows]
            computed_dev = rows
            positions = computed_dev + P
            angles = chunks = None
            everything = False
        full_k.index_copy_(2, positions, k)
        full_v.index_copy_(2, positions, v)
        gqa = q.shape[1] != kv_heads
        if everything and P == 0:
            # Every position is a query: a plain causal attention (the fast kernel).
            out = F.scaled_dot_product_attention(q, full_k, full_v, is_causal=True, scale=attn.scaling, enable_gqa=gqa)
        elif everything and device.type == "cpu":
            # Every position from P on is a query over the cached prefix: unmasked over the prefix,
            # causal over the rest, merged (the masked kernel would take twice as long).
            out = prefix_then_causal(q, full_k, full_v, attn.scaling)
        elif device.type == "cpu":
            if chunks is None:
                chunks = _row_chunks(positions, key_positions, q.dtype)
            out = _attend_in_row_chunks(q, full_k, full_v, chunks, attn.scaling, gqa)
        else:
            mask = key_positions.unsqueeze(0) <= positions.unsqueeze(1)
            out = F.scaled_dot_product_attention(q, full_k, full_v, attn_mask=mask, scale=attn.scaling, enable_gqa=gqa)
        out = attn.o_proj(out.transpose(1, 2).reshape(1, out.shape[2], -1))
        hidden = hidden + out
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        cache.fill(li, full_k, full_v)
        per_layer.append(int(hidden.shape[1]))
    logits = model.lm_head(base.norm(hidden[:, -1:]))[0, -1]
    return BlendOutcome(
        cache=cache,
        logits=logits,
        reused_tokens=m - recomputed,
        recomputed_tokens=recomputed,
        computed_tokens_per_layer=per_layer,
    )
