"""Load-following: which built-in mode the fleet's traffic calls for, as pure functions.

The fleet's shape (requests a minute, share of long prompts, mean prompt length, device-tier
pressure, queue depth) picks one of chat-peak, long-doc, nightly-batch or none. Each mode has an
enter threshold and a looser leave threshold (hysteresis), so traffic near a threshold does not
flip the mode at every sample; and a mode, once switched to, stays at least `min_dwell_seconds`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

CHAT_PEAK = "chat-peak"
LONG_DOC = "long-doc"
NIGHTLY_BATCH = "nightly-batch"
NONE = ""
KINDS = (CHAT_PEAK, LONG_DOC, NIGHTLY_BATCH)


@dataclasses.dataclass(frozen=True)
class Shape:
    """The fleet's traffic over the recent window."""

    requests_per_min: float
    long_share: float  # fraction of prompts of at least `long_prompt_tokens`
    mean_prompt_tokens: float
    l1_pressure: float  # device-tier use / capacity, 0..1 (fleet mean)
    queue_depth: float  # requests waiting, summed over the fleet
    nodes: int = 1


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """Enter and leave thresholds of each mode. Leave thresholds are looser than enter ones."""

    long_prompt_tokens: int = 2048
    chat_enter_rpm: float = 120.0
    chat_leave_rpm: float = 80.0
    long_enter_share: float = 0.5
    long_leave_share: float = 0.3
    quiet_enter_rpm: float = 5.0
    quiet_leave_rpm: float = 15.0
    pressure_enter: float = 0.85
    queue_enter: float = 8.0
    min_dwell_seconds: float = 600.0

    def check(self) -> None:
        """Raise ValueError naming the first threshold that is out of range or not looser on leave."""
        for name in (
            "chat_enter_rpm",
            "chat_leave_rpm",
            "quiet_enter_rpm",
            "quiet_leave_rpm",
            "queue_enter",
            "min_dwell_seconds",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: cannot be negative, got {getattr(self, name)}")
        for name in ("long_enter_share", "long_leave_share", "pressure_enter"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name}: expected a fraction in [0, 1], got {getattr(self, name)}")
        if self.long_prompt_tokens < 1:
            raise ValueError(f"long_prompt_tokens: must be at least 1, got {self.long_prompt_tokens}")
        if self.chat_leave_rpm > self.chat_enter_rpm:
            raise ValueError("chat_leave_rpm: must not exceed chat_enter_rpm (leaving is looser than entering)")
        if self.long_leave_share > self.long_enter_share:
            raise ValueError("long_leave_share: must not exceed long_enter_share (leaving is looser than entering)")
        if self.quiet_leave_rpm < self.quiet_enter_rpm:
            raise ValueError("quiet_leave_rpm: must not be below quiet_enter_rpm (leaving is looser than entering)")
        if self.quiet_leave_rpm > self.chat_leave_rpm:
            raise ValueError("quiet_leave_rpm: must not exceed chat_leave_rpm (quiet and chat peak would overlap)")


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the traffic calls for: `target` (a kind, or "" for no mode), whether to switch now,
    and the reason in words (the measured shape, or why the switch waits)."""

    target: str
    switch: bool
    reason: str


def _fits(kind: str, shape: Shape, t: Thresholds, *, entering: bool) -> bool:
    """Whether `shape` calls for `kind`: against the enter thresholds, or the leave ones when
    `kind` is the mode in force."""
    quiet = shape.requests_per_min <= (t.quiet_enter_rpm if entering else t.quiet_leave_rpm) and shape.queue_depth < 1
    if kind == NIGHTLY_BATCH:
        return quiet
    long_docs = shape.long_share >= (t.long_enter_share if entering else t.long_leave_share)
    if kind == LONG_DOC:
        return long_docs and shape.requests_per_min > t.quiet_enter_rpm
    if kind == CHAT_PEAK:
        busy = shape.requests_per_min >= (t.chat_enter_rpm if entering else t.chat_leave_rpm)
        pressed = shape.l1_pressure >= t.pressure_enter and shape.queue_depth >= t.queue_enter
        # Long documents take over a chat peak as soon as they pass their enter threshold.
        return (busy or pressed) and shape.long_share < t.long_enter_share
    raise ValueError(f"kind: unknown mode kind {kind!r}; expected one of {', '.join(KINDS)}")


def classify(shape: Shape, t: Thresholds, *, current: str = NONE) -> str:
    """The kind the traffic calls for: `current` while it still fits its leave thresholds, else
    the first of long-doc, chat-peak, nightly-batch whose enter thresholds it meets, else ""."""
    if current and _fits(current, shape, t, entering=False):
        return current
    for kind in (LONG_DOC, CHAT_PEAK, NIGHTLY_BATCH):
        if _fits(kind, shape, t, entering=True):
            return kind
    return NONE


def describe(shape: Shape, t: Thresholds, target: str) -> str:
    """The measured shape and the mode it leads to, in one line (a policy version's comment)."""
    short = 1.0 - shape.long_share
    return (
        f"load-following: {shape.requests_per_min:.0f} req/min, {short:.0%} prompts < {t.long_prompt_tokens} tokens "
        f"(mean {shape.mean_prompt_tokens:.0f}), L1 {shape.l1_pressure:.0%}, queue {shape.queue_depth:.0f}, "
        f"{shape.nodes} node(s) → {target or 'no mode'}"
    )


def decide(shape: Shape, t: Thresholds, *, current: str, dwelt_seconds: float | None) -> Decision:
    """Classify `shape` given the mode in force and how long it has been in force (None: not
    switched by load-following yet, so no dwell applies)."""
    target = classify(shape, t, current=current)
    reason = describe(shape, t, target)
    if target == current:
        return Decision(target=target, switch=False, reason=reason)
    if dwelt_seconds is not None and dwelt_seconds < t.min_dwell_seconds:
        wait = t.min_dwell_seconds - dwelt_seconds
        return Decision(
            target=target,
            switch=False,
            reason=f"{reason} after the minimum dwell ({wait:.0f} s to go in {current or 'no mode'})",
        )
    return Decision(target=target, switch=True, reason=reason)


@dataclasses.dataclass(frozen=True)
class NodeSample:
    """One node's latest traffic summary, as the fleet shape needs it."""

    requests: int
    window_seconds: float
    long_prompts: int
    prompt_tokens: int
    l1_pressure: float
    queue_depth: float


def fleet_shape(samples: Iterable[NodeSample]) -> Shape | None:
    """Sum the nodes' rates and queues, weight prompt shares by requests, average L1 pressure.
    None when no node reported."""
    samples = list(samples)
    if not samples:
        return None
    requests = sum(s.requests for s in samples)
    rpm = sum(s.requests * 60.0 / s.window_seconds for s in samples if s.window_seconds > 0)
    return Shape(
        requests_per_min=rpm,
        long_share=sum(s.long_prompts for s in samples) / requests if requests else 0.0,
        mean_prompt_tokens=sum(s.prompt_tokens for s in samples) / requests if requests else 0.0,
        l1_pressure=sum(s.l1_pressure for s in samples) / len(samples),
        queue_depth=sum(s.queue_depth for s in samples),
        nodes=len(samples),
    )
