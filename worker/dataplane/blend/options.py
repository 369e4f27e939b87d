"""Blend settings of one engine (one model): the recompute ratio per namespace and the auto-tuner's knobs."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

SELECTIONS = ("deviation", "chunk-start")
"""How the tokens to recompute are chosen: CacheBlend's largest KV deviation at the check layer,
or EPIC's first tokens of every reused run (no check layer, cheaper, usually less accurate)."""

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class BlendError(ValueError):
    """A blend setting or a request's segments are invalid; `field` names the problem."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def check_percent(field: str, value: Any) -> float:
    """A recompute ratio in percent, 0..100 inclusive."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BlendError(field, f"must be a number of percent between 0 and 100, got {value!r}")
    if not 0 <= value <= 100:
        raise BlendError(field, f"must be between 0 and 100 percent, got {value}")
    return float(value)


def parse_namespace_percents(value: Any) -> dict[str, float]:
    """`ns=percent,ns2=percent` (or a mapping) into {namespace: percent}, each checked."""
    if isinstance(value, Mapping):
        pairs = [(str(k), v) for k, v in value.items()]
    else:
        pairs = []
        for item in filter(None, (part.strip() for part in str(value).split(","))):
            name, sep, percent = item.partition("=")
            if not sep or not name.strip():
                raise BlendError("blend_namespace_percent", f"expected namespace=percent pairs, got {item!r}")
            try:
                number = float(percent)
            except ValueError:
                raise BlendError("blend_namespace_percent", f"{percent!r} of {name.strip()} is not a number") from None
            pairs.append((name.strip(), number))
    result = {}
    for name, percent in pairs:
        if not _NAMESPACE_RE.match(name):
            raise BlendError("blend_namespace_percent", f"{name!r} is not a namespace name")
        result[name] = check_percent(f"blend_namespace_percent[{name}]", percent)
    return result


@dataclasses.dataclass(frozen=True)
class BlendOptions:
    """Fragment reuse of one engine. `recompute_percent` is r: the share of reused fragment tokens
    recomputed at every layer after the check layer; a namespace may have its own r."""

    enabled: bool = False
    recompute_percent: float = 15.0
    namespace_percent: Mapping[str, float] = dataclasses.field(default_factory=dict)
    selection: str = "deviation"
    check_layer: int = 1
    """The layer whose fresh-vs-reused KV deviation picks the tokens to recompute (CacheBlend: 1).
    Layers before it are computed for every token."""
    sample_rate: float = 0.05
    """Share of blended requests also run with a full prefill in the background to measure agreement."""
    agreement_threshold: float = 0.9
    """Below this share of agreeing samples (same greedy token, KL under `max_kl`) r is raised."""
    max_kl: float = 0.1
    min_samples: int = 20
    """Samples needed before the agreement is judged (the window is cleared after each change)."""
    raise_step_percent: float = 15.0
    max_percent: float = 60.0
    """Past this r, poor agreement means falling back to prefix-only reuse for the namespace."""
    min_fragment_blocks: int = 1

    def __post_init__(self) -> None:
        check_percent("recompute_percent", self.recompute_percent)
        check_percent("max_percent", self.max_percent)
        check_percent("raise_step_percent", self.raise_step_percent)
        for name, percent in self.namespace_percent.items():
            check_percent(f"namespace_percent[{name}]", percent)
        if self.selection not in SELECTIONS:
            raise BlendError("selection", f"expected one of {', '.join(SELECTIONS)}, got {self.selection!r}")
        if isinstance(self.check_layer, bool) or not isinstance(self.check_layer, int) or self.check_layer < 1:
            raise BlendError("check_layer", f"must be an integer of at least 1, got {self.check_layer!r}")
        if not 0 <= self.sample_rate <= 1:
            raise BlendError("sample_rate", f"must be between 0 and 1, got {self.sample_rate}")
        if not 0 <= self.agreement_threshold <= 1:
            raise BlendError("agreement_threshold", f"must be between 0 and 1, got {self.agreement_threshold}")
        if self.max_kl < 0:
            raise BlendError("max_kl", f"cannot be negative, got {self.max_kl}")
        if self.min_samples < 1:
            raise BlendError("min_samples", f"must be at least 1, got {self.min_samples}")
        if self.min_fragment_blocks < 1:
            raise BlendError("min_fragment_blocks", f"must be at least 1, got {self.min_fragment_blocks}")

    def percent_for(self, namespace: str) -> float:
        return self.namespace_percent.get(namespace, self.recompute_percent)

    @classmethod
    def from_config(cls, config: Any) -> BlendOptions:
        """From the node options (`blend`, `blend_recompute_percent`, ...) of a NodeConfig."""
        return cls(
            enabled=config.blend, recompute_percent=config.blend_recompute_percent,
            namespace_percent=dict(config.blend_namespace_percent), sample_rate=config.blend_sample_rate,
            agreement_threshold=config.blend_agreement_threshold,
        )
