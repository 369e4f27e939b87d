"""Attention for a suffix computed over a cached prefix, without copying the cached keys per head.

A prompt whose first blocks come from the tiers is prefilled from the first missing token: its
queries (the suffix) attend to every cached key and to the earlier suffix tokens, so attention
runs with a mask. transformers' `sdpa` path, given a mask on a grouped-query model, first
expands the key/value heads to one per query head (`repeat_kv`): with 4 query heads per KV head
and an 8K-token prefix that copies 4x the prefix's K and V in every layer, and SDPA then takes its
masked path on the copies. On CPU, SDPA itself can read each KV head for its group of queries
(`enable_gqa`, supported with a mask on CPU): many times faster for a short suffix over a long
prefix, with identical outputs (benchmarks/README.md).

When the mask is the plain one of a suffix over a cached prefix (every suffix token sees the
whole prefix and the suffix tokens up to itself: causal, aligned to the bottom right) and the
call is large, the masked kernel is avoided altogether: attention over the prefix runs unmasked
(the query heads of a KV head folded into one long query, so the prefix is read once per KV
head), attention over the suffix runs causal, both through SDPA's CPU flash kernel, and the two
are merged by their log-sum-exp: faster than the masked kernel for long suffixes, with outputs
equal to float rounding (benchmarks/README.md).

`strata_sdpa` is registered with transformers as an attention implementation: on CPU, for a
grouped-query model and a masked call, it calls SDPA with `enable_gqa` (or the split above);
everything else goes to transformers' own `sdpa` (a GPU's kernels take GQA without a mask only,
so it stays there)."""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "strata_sdpa"


SPLIT_MIN_SCORES = 1 << 20
"""A masked call with at least this many query x key scores (per head) takes the split path when
its mask allows; below it the masked kernel is as fast and the mask check is not worth it."""

_checked = threading.local()


def _is_suffix_causal(mask: torch.Tensor) -> bool:
    """True when `mask` ([batch, 1, q, k] booleans, q < k) lets query i see keys 0 .. k - q + i,
    in every batch row. Checked once per mask: a forward pass hands the same mask to every layer
    (remembered by identity, never by address, so a new mask is always checked)."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1:
        return False
    q, k = mask.shape[-2], mask.shape[-1]
    if not 1 < q < k:
        return False
    last = getattr(_checked, "last", None)
    if last is not None and last[0]() is mask and last[1] == mask.data_ptr():
        return bool(last[2])
    expected = torch.ones(q, k, dtype=torch.bool, device=mask.device).tril(k - q)
    result = all(torch.equal(row[0], expected) for row in mask)
    _checked.last = (weakref.ref(mask), mask.data_ptr(), result)
    return result


def prefix_then_causal(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """Attention of `query` ([b, heads, q, d]) over `key`/`value` ([b, kv_heads, k, d]) whose
    last q positions are the queries' own: unmasked over the first k - q, causal over the last
    q, merged by log-sum-exp. Returns [b, heads, q, d]."""
    batch, heads, q, dim = query.shape
    kv_heads, k = key.shape[1], key.shape[2]
    groups, prefix = heads // kv_heads, k - q
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    folded = query.reshape(batch, kv_heads, groups * q, dim)  # head h reads KV head h // groups
    out_p, lse_p = flash(folded, key[:, :, :prefix], value[:, :, :prefix], scale=scaling)[:2]
    out_p, lse_p = out_p.reshape(batch, heads, q, dim), lse_p.reshape(batch, heads, q)
    own_k = key[:, :, prefix:].repeat_interleave(groups, dim=1)
    own_v = value[:, :, prefix:].repeat_interleave(groups, dim=1)
    out_s, lse_s = flash(query, own_k, own_v, is_causal=True, scale=scaling)[:2]
    top = torch.maximum(lse_p, lse_s)
    w_p, w_s = (lse_p - top).exp(), (lse_s - top).exp()
    total = w_p + w_s
    merged = out_p.float() * (w_p / total).unsqueeze(-1) + out_s.float() * (w_s / total).unsqueeze(-1)
    return merged.to(query.dtype)


def strata_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    groups = getattr(module, "num_key_value_groups", 1)
    if (
        attention_mask is not None
        and query.device.type == "cpu"
        and dropout == 0.0
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and key.shape[-1] == value.shape[-1] == query.shape[-1]
        and query.shape[1] % key.shape[1] == 0
        and query.shape[2] * key.shape[2] >= SPLIT_MIN_SCORES
        and _is_suffix_causal(attention_mask)
    ):
        return prefix_then_causal(query, key, value, scaling).transpose(1, 2).contiguous(), None
    if (
        attention_mask is None
        or groups <= 1
        or query.device.type != "cpu"
        or query.shape[2] == 1  # one query: transformers packs the group into rows already
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
        or key.shape[-1] != value.shape[-1]
    ):
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make `strata_sdpa` known to transformers (idempotent); returns its name."""
    AttentionInterface.register(NAME, strata_sdpa_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    return NAME
