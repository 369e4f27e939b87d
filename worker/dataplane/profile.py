"""A model's profile (everything that changes its KV bytes) and its model key, without torch.

The control plane reads profiles and computes model keys when a profile is registered; it never
lays out block bytes, so this module imports neither torch nor numpy. The torch-backed byte
layout of a profile's blocks is `layout.block_layout(profile)`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import uuid
from collections.abc import Mapping
from typing import Any

KEY_BYTES = 16
"""Bytes of every key: model, prefix and content keys are 128-bit."""

PERSON_MODEL = b"strata/model/v1"
"""BLAKE2b personalisation of model keys (apart from prefix and content keys, see `hashing`)."""

KV_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
"""KV dtypes the data plane stores, by their canonical names."""

DTYPE_ALIASES: dict[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}
"""Every name a KV dtype may be given by, and its canonical name."""


def canonical_dtype(value: Any) -> str:
    """The canonical name of a supported KV dtype given by a name such as 'bf16' or 'float16' (or
    a torch dtype, whose str() is 'torch.float16')."""
    name = str(value).lower().removeprefix("torch.")
    if name not in DTYPE_ALIASES:
        raise ValueError(f"unsupported KV dtype {value!r}; expected float32, float16 or bfloat16")
    return DTYPE_ALIASES[name]


def positive_int(name: str, value: Any) -> int:
    """`value` when it is a positive int (not a bool); ValueError naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class ModelProfile:
    """Everything about a model that changes its KV bytes; `model_key` hashes all of it."""

    model_id: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    block_tokens: int = 256
    revision: str = "main"
    """Which weights: a hub checkpoint's commit hash, `content-<digest>` of any other checkpoint
    directory (`models.checkpoints.checkpoint_revision`), `random-seed-<n>` of a preset."""
    rope_theta: float = 10000.0
    rope_scaling: str = ""
    """Canonical JSON of the RoPE scaling config ('' when none); see `with_rope_scaling`."""

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("model_id cannot be empty")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        for name in ("layers", "kv_heads", "head_dim", "block_tokens"):
            positive_int(name, getattr(self, name))

    @staticmethod
    def canonical_rope_scaling(scaling: Mapping[str, Any] | None) -> str:
        return "" if not scaling else json.dumps(scaling, sort_keys=True, separators=(",", ":"))

    def with_rope_scaling(self, scaling: Mapping[str, Any] | None) -> ModelProfile:
        return dataclasses.replace(self, rope_scaling=self.canonical_rope_scaling(scaling))


def model_key(profile: ModelProfile) -> uuid.UUID:
    """Hash of everything that changes a model's KV bytes: id, revision, dtype, layers, kv heads,
    head dim, block_tokens and RoPE settings (canonical JSON, so field order never matters)."""
    fields = dataclasses.asdict(profile)
    fields["rope_theta"] = float(fields["rope_theta"]).hex()  # exact, no float formatting drift
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return uuid.UUID(bytes=hashlib.blake2b(canonical, digest_size=KEY_BYTES, person=PERSON_MODEL).digest())
