"""RoPE re-alignment: moving cached keys to new positions by rotating them by the position difference.

Rotary embeddings rotate each pair of a key's dimensions by position x frequency, and rotations
compose: R(p + d) = R(d) R(p). A key cached at position p is therefore moved to p + d exactly by
applying the model's own rotary embedding at position d - no need to recompute it. Values carry
no position and are reused as they are.
"""

from __future__ import annotations

from typing import Any

import torch

_EXACT_ROPE_TYPES = {"default", "linear", "llama3", "longrope", "yarn"}
"""RoPE variants whose angle is a fixed per-dimension frequency times the position (so shifts
compose); 'dynamic' changes the frequencies with the sequence length and cannot be re-aligned."""


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_problem(rotary: Any) -> str | None:
    """Why keys of this rotary embedding cannot be re-aligned by a rotation, or None if they can."""
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type not in _EXACT_ROPE_TYPES:
        return f"RoPE type {rope_type!r} changes its frequencies with the context length"
    if float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        return "the RoPE embedding scales cos/sin (attention_scaling != 1), so a second rotation is not a shift"
    return None


def rotation(rotary: Any, shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (float32, [1, 1, tokens, head_dim]) that move keys by `shift[t]` positions each."""
    probe = torch.empty(0, dtype=torch.float32, device=shift.device)
    cos, sin = rotary(probe, position_ids=shift.reshape(1, -1))
    return cos.to(torch.float32).unsqueeze(1), sin.to(torch.float32).unsqueeze(1)


def rotate(keys: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Keys `[batch, kv_heads, tokens, head_dim]` rotated by `angles` (from `rotation`), in float32
    and returned in the keys' dtype."""
    cos, sin = angles
    work = keys.to(torch.float32)
    return (work * cos + rotate_half(work) * sin).to(keys.dtype)


def rerotate(keys: torch.Tensor, shift: torch.Tensor, rotary: Any) -> torch.Tensor:
    """Keys `[batch, kv_heads, tokens, head_dim]` rotated by `shift[t]` positions each (negative
    moves them earlier), computed in float32 and returned in the keys' dtype."""
    if keys.shape[-2] != shift.shape[-1]:
        raise ValueError(f"shift: {shift.shape[-1]} shifts for {keys.shape[-2]} keys")
    return rotate(keys, rotation(rotary, shift.to(keys.device)))
