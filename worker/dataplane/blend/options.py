"""Blend settings of one engine (one model): the recompute ratio per model and namespace and the auto-tuner's knobs."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

SELECTIONS = ("deviation", "chunk-start")
"""How the tokens to recompute are chosen: CacheBlend's largest KV deviation at the check layer,
or EPIC's first tokens of every reused run (no check layer, cheaper, usually less accurate)."""

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_MODEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:+-]{0,127}$")
"""A model as the engine names it: a preset name or the directory name of a local checkpoint."""


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


def check_namespace_key(field: str, key: str) -> str:
    """A key of the namespace map: `namespace`, or `model/namespace` for one model's namespace."""
    model, sep, namespace = key.rpartition("/")
    if sep and not _MODEL_RE.match(model):
        raise BlendError(field, f"{model!r} of {key!r} is not a model name")
    if not _NAMESPACE_RE.match(namespace):
        raise BlendError(field, f"{namespace!r} of {key!r} is not a namespace name")
    return key


def check_model_key(field: str, key: str) -> str:
    if not _MODEL_RE.match(key):
        raise BlendError(field, f"{key!r} is not a model name (letters, digits, '.', '_', '-', ':', '+')")
    return key


def _parse_percent_map(value: Any, *, option: str, what: str, check_key: Callable[[str, str], str]) -> dict[str, float]:
    """`key=percent,key2=percent` (or a mapping) into {key: percent}, each key and percent checked."""
    if isinstance(value, Mapping):
        pairs = [(str(k), v) for k, v in value.items()]
    else:
        pairs = []
        for item in filter(None, (part.strip() for part in str(value).split(","))):
            name, sep, percent = item.partition("=")
            if not sep or not name.strip():
                raise BlendError(option, f"expected {what}, got {item!r}")
            try:
                number = float(percent)
            except ValueError:
                raise BlendError(option, f"{percent!r} of {name.strip()} is not a number") from None
            pairs.append((name.strip(), number))
    result: dict[str, float] = {}
    for name, percent in pairs:
        check_key(option, name)
        if name in result:
            raise BlendError(option, f"{name} is given twice")
        result[name] = check_percent(f"{option}[{name}]", percent)
    return result


def parse_namespace_percents(value: Any) -> dict[str, float]:
    """`ns=percent,model/ns=percent` (or a mapping) into {key: percent}, each checked. A key with a
    model applies to that model's namespace only, so one fleet-wide setting serves nodes of
    different models."""
    return _parse_percent_map(
        value,
        option="blend_namespace_percent",
        what="namespace=percent pairs (or model/namespace=percent)",
        check_key=check_namespace_key,
    )


def parse_model_percents(value: Any) -> dict[str, float]:
    """`model=percent,...` (or a mapping) into {model: percent}: r of every namespace of that model
    without an entry of its own."""
    return _parse_percent_map(
        value, option="blend_model_percent", what="model=percent pairs", check_key=check_model_key
    )


@dataclasses.dataclass(frozen=True)
class BlendOptions:
    """Fragment reuse of one engine. `recompute_percent` is r: the share of reused fragment tokens
    recomputed at every layer after the check layer. r of a namespace is, first found:
    `namespace_percent["model/namespace"]`, `namespace_percent["namespace"]`,
    `model_percent["model"]`, `recompute_percent`."""

    enabled: bool = False
    recompute_percent: float = 15.0
    namespace_percent: Mapping[str, float] = dataclasses.field(default_factory=dict)
    model_percent: Mapping[str, float] = dataclasses.field(default_factory=dict)
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
    reprobe_seconds: float = 600.0
    """After a fallback, blending is tried again (at the r it fell back at) after this long; each
    probe that falls back again doubles the wait, up to 16 times. 0: only an operator resumes it."""

    def __post_init__(self) -> None:
        check_percent("recompute_percent", self.recompute_percent)
        check_percent("max_percent", self.max_percent)
        check_percent("raise_step_percent", self.raise_step_percent)
        for name, percent in self.namespace_percent.items():
            check_namespace_key("namespace_percent", name)
            check_percent(f"namespace_percent[{name}]", percent)
        for name, percent in self.model_percent.items():
            check_model_key("model_percent", name)
            check_percent(f"model_percent[{name}]", percent)
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
        if self.raise_step_percent <= 0:
            # A step of 0 would judge the same r over and over without ever reaching the fallback.
            raise BlendError("raise_step_percent", f"must be greater than 0, got {self.raise_step_percent}")
        if self.min_fragment_blocks < 1:
            raise BlendError("min_fragment_blocks", f"must be at least 1, got {self.min_fragment_blocks}")
        if self.reprobe_seconds < 0:
            raise BlendError("reprobe_seconds", f"cannot be negative, got {self.reprobe_seconds}")

    def model_default(self, model: str) -> float:
        """r of a namespace of `model` that has no entry of its own."""
        return self.model_percent.get(model, self.recompute_percent)

    def percent_for(self, namespace: str, model: str = "") -> float:
        """r of `namespace` of `model`: model/namespace entry, namespace entry, model entry, default."""
        if model and (percent := self.namespace_percent.get(f"{model}/{namespace}")) is not None:
            return percent
        if (percent := self.namespace_percent.get(namespace)) is not None:
            return percent
        return self.model_default(model)

    def configured_namespaces(self, model: str) -> list[str]:
        """Namespaces with an r of their own for `model` (entries of other models left out)."""
        names = set()
        for key in self.namespace_percent:
            owner, sep, namespace = key.rpartition("/")
            if not sep or owner == model:
                names.add(namespace)
        return sorted(names)

    @classmethod
    def from_config(cls, config: Any) -> BlendOptions:
        """From the node options (`blend`, `blend_recompute_percent`, ...) of a NodeConfig."""
        return cls(
            enabled=config.blend,
            recompute_percent=config.blend_recompute_percent,
            namespace_percent=dict(config.blend_namespace_percent),
            model_percent=dict(config.blend_model_percent),
            selection=config.blend_selection,
            check_layer=config.blend_check_layer,
            sample_rate=config.blend_sample_rate,
            agreement_threshold=config.blend_agreement_threshold,
            max_kl=config.blend_max_kl,
            min_samples=config.blend_min_samples,
            raise_step_percent=config.blend_raise_step_percent,
            max_percent=config.blend_max_percent,
            min_fragment_blocks=config.blend_min_fragment_blocks,
            reprobe_seconds=config.blend_reprobe_seconds,
        )
