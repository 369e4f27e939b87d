"""Auto-tune and fallback: sampled requests are re-run with a full prefill in the background and
compared; poor agreement raises r for the namespace, past the ceiling falls back to prefix-only,
and after a cooldown blending is probed again."""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence

import torch

from worker.dataplane.blend.options import BlendOptions, check_percent
from worker.dataplane.counters import Counters

log = logging.getLogger("strata.blend")

BLEND, PREFIX_ONLY = "blend", "prefix-only"


MAX_BACKOFF_DOUBLINGS = 4
"""A namespace whose probes keep falling back waits at most 2**4 = 16 cooldowns between them."""


@dataclasses.dataclass
class NamespaceState:
    """The blend state of one namespace of one model."""

    percent: float
    mode: str = BLEND
    window: collections.deque[bool] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=200))
    samples: int = 0
    agreed: int = 0
    raised: int = 0
    last_kl: float | None = None
    reprobe_at: float | None = None
    """Clock time at which a fallen-back namespace blends again (None: never by itself)."""
    probing: bool = False
    """Blending again after a fallback, not yet judged."""
    failed_probes: int = 0
    """Probes in a row that fell back again; each doubles the next cooldown."""

    def as_dict(self, now: float | None = None) -> dict[str, object]:
        window = list(self.window)
        reprobe_in = (
            max(0.0, self.reprobe_at - now)
            if self.reprobe_at is not None and now is not None and self.mode == PREFIX_ONLY
            else None
        )
        return {
            "recompute_percent": self.percent,
            "mode": self.mode,
            "samples": self.samples,
            "agreed": self.agreed,
            "window_samples": len(window),
            "window_agreement": (sum(window) / len(window)) if window else None,
            "raised": self.raised,
            "last_kl": self.last_kl,
            "probing": self.probing,
            "reprobe_in_s": reprobe_in,
        }


def agreement(blended: torch.Tensor, full: torch.Tensor) -> tuple[bool, float]:
    """Whether the blended first-token logits choose the full prefill's greedy token, and KL(full || blended)."""
    full_logp = torch.log_softmax(full.float(), dim=-1)
    blend_logp = torch.log_softmax(blended.float(), dim=-1)
    kl = float(torch.sum(full_logp.exp() * (full_logp - blend_logp)))
    return bool(torch.argmax(full) == torch.argmax(blended)), max(kl, 0.0)


@dataclasses.dataclass(frozen=True)
class Sample:
    namespace: str
    prompt: list[int]
    blended_logits: torch.Tensor
    percent: float


class BlendTuner:
    """Per namespace: the current r, the mode, the agreement window; plus the background checker.

    `full_prefill(prompt)` returns the logits of the last prompt position computed without any
    cache; it runs on the checker thread (the engine serialises it with its requests). Without it
    (None) samples are judged elsewhere and handed to `record` (a vLLM node judges them in vLLM's
    worker). `clock` (seconds, monotonic) times the re-probe after a fallback."""

    def __init__(
        self,
        *,
        options: BlendOptions,
        full_prefill: Callable[[Sequence[int]], torch.Tensor] | None,
        counters: Counters,
        model: str,
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.options = options
        self.full_prefill = full_prefill
        self.counters = counters
        self.model = model
        self.clock = clock
        # Namespaces configured with an r of their own are known (and exported) before their first request.
        self._states: dict[str, NamespaceState] = {
            name: NamespaceState(percent=options.percent_for(name, model))
            for name in options.configured_namespaces(model)
        }
        self._lock = threading.Lock()
        self._random = random.Random(seed)
        self._queue: queue.Queue[Sample | None] = queue.Queue(maxsize=8)
        self._thread: threading.Thread | None = None
        self._idle = threading.Condition(self._lock)
        self._busy = 0

    def state(self, namespace: str) -> NamespaceState:
        with self._lock:
            return self._state(namespace)

    @property
    def default_percent(self) -> float:
        """The configured r of this model's namespaces that have no entry of their own."""
        return self.options.model_default(self.model)

    def _state(self, namespace: str) -> NamespaceState:
        if namespace not in self._states:
            self._states[namespace] = NamespaceState(percent=self.options.percent_for(namespace, self.model))
        state = self._states[namespace]
        if state.mode == PREFIX_ONLY and state.reprobe_at is not None and self.clock() >= state.reprobe_at:
            self._reprobe(namespace, state)
        return state

    def _reprobe(self, namespace: str, state: NamespaceState) -> None:
        # The r it fell back at: the lower ones were already judged too poor.
        state.mode, state.probing, state.reprobe_at = BLEND, True, None
        state.window.clear()
        self.counters.add("blend.reprobes")
        log.info(
            "model %s namespace %s: blending again at %.0f%% recompute to see whether agreement has recovered",
            self.model,
            namespace,
            state.percent,
        )

    def current(self, namespace: str) -> tuple[str, float]:
        """(mode, r in percent) to use for a request of this namespace now."""
        with self._lock:
            state = self._state(namespace)
            return state.mode, state.percent

    def snapshot(self) -> dict[str, dict[str, object]]:
        with self._lock:
            now = self.clock()
            return {name: self._state(name).as_dict(now) for name in sorted(self._states)}

    def sampled(self) -> bool:
        """Whether to sample the next blended request (drawn at `sample_rate`)."""
        if self.options.sample_rate <= 0:
            return False
        with self._lock:
            return self._random.random() < self.options.sample_rate

    # -- sampling ----------------------------------------------------------------------------
    def offer(self, namespace: str, prompt: Sequence[int], blended_logits: torch.Tensor, percent: float) -> bool:
        """Maybe queue a blended request for a background comparison; True if queued."""
        if self.full_prefill is None:
            raise RuntimeError("this tuner judges no samples itself: hand them to record()")
        if not self.sampled():
            return False
        self._ensure_thread()
        try:
            with self._lock:
                self._busy += 1
            self._queue.put_nowait(Sample(namespace, list(prompt), blended_logits.detach().float().cpu(), percent))
        except queue.Full:
            with self._lock:
                self._busy -= 1
            self.counters.add("blend.samples_dropped")
            return False
        self.counters.add("blend.samples_queued")
        return True

    def drain(self, timeout: float = 60.0) -> bool:
        """Wait until every queued sample is judged; False if `timeout` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, timeout=timeout)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)
            self._thread = None

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="strata-blend-check", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            sample = self._queue.get()
            if sample is None:
                return
            try:
                assert self.full_prefill is not None  # offer() queues nothing without it
                full = self.full_prefill(sample.prompt)
                agree, kl = agreement(sample.blended_logits, full.float().cpu())
                self.record(sample.namespace, agree=agree, kl=kl, percent=sample.percent)
            except Exception:  # noqa: BLE001 - a failed check must not stop later ones
                log.exception("blend quality check failed")
                self.counters.add("blend.check_failures")
            finally:
                with self._idle:
                    self._busy -= 1
                    self._idle.notify_all()

    # -- the policy ----------------------------------------------------------------------------
    def record(self, namespace: str, *, agree: bool, kl: float, percent: float) -> None:
        """Count one comparison and act on the window: raise r, or fall back to prefix-only."""
        ok = agree and kl <= self.options.max_kl
        self.counters.add("blend.samples_agreed" if ok else "blend.samples_disagreed")
        with self._lock:
            state = self._state(namespace)
            if state.mode != BLEND or percent != state.percent:
                return  # judged under settings that have changed since
            state.samples += 1
            state.agreed += int(ok)
            state.last_kl = kl
            state.window.append(ok)
            window = list(state.window)
            if len(window) < self.options.min_samples:
                return
            rate = sum(window) / len(window)
            if rate >= self.options.agreement_threshold:
                if state.probing:
                    state.probing, state.failed_probes = False, 0
                    log.info(
                        "model %s namespace %s: blending at %.0f%% recompute agrees again (%.0f%% of %d samples)",
                        self.model,
                        namespace,
                        state.percent,
                        100 * rate,
                        len(window),
                    )
                return
            state.window.clear()
            if state.percent < self.options.max_percent:
                before = state.percent
                state.percent = min(self.options.max_percent, state.percent + self.options.raise_step_percent)
                state.raised += 1
                self.counters.add("blend.ratio_raised")
                log.warning(
                    "model %s namespace %s: blended answers agreed with full prefill in %.0f%% of %d samples "
                    "(threshold %.0f%%); recomputing %.0f%% of fragment tokens instead of %.0f%%",
                    self.model,
                    namespace,
                    100 * rate,
                    len(window),
                    100 * self.options.agreement_threshold,
                    state.percent,
                    before,
                )
            else:
                state.mode = PREFIX_ONLY
                if state.probing:
                    state.failed_probes += 1
                state.probing = False
                cooldown = self.options.reprobe_seconds * 2 ** min(state.failed_probes, MAX_BACKOFF_DOUBLINGS)
                state.reprobe_at = self.clock() + cooldown if cooldown > 0 else None
                self.counters.add("blend.fallbacks")
                log.warning(
                    "model %s namespace %s: blended answers agreed with full prefill in %.0f%% of %d samples "
                    "even at %.0f%% recompute; falling back to prefix-only reuse%s",
                    self.model,
                    namespace,
                    100 * rate,
                    len(window),
                    state.percent,
                    f" for {cooldown:.0f} s" if cooldown > 0 else " until an operator resumes blending",
                )

    def set_percent(self, namespace: str, percent: float) -> dict[str, object]:
        """An operator's r for a namespace: blending resumes at it and the window starts afresh.
        Returns the namespace's new state."""
        value = check_percent("recompute_percent", percent)
        with self._lock:
            state = self._state(namespace)
            state.percent, state.mode = value, BLEND
            state.probing, state.failed_probes, state.reprobe_at = False, 0, None
            state.window.clear()
            self.counters.add("blend.operator_changes")
            answer = state.as_dict(self.clock())
        log.info("model %s namespace %s: recompute ratio set to %.1f%% by an operator", self.model, namespace, value)
        return answer

    def reset(self, namespace: str) -> dict[str, object]:
        """Back to the configured r and blending, its history forgotten (an operator's decision,
        e.g. after a fallback). Returns the namespace's new state."""
        with self._lock:
            state = self._states[namespace] = NamespaceState(percent=self.options.percent_for(namespace, self.model))
            self.counters.add("blend.operator_changes")
            answer = state.as_dict(self.clock())
        log.info(
            "model %s namespace %s: blend state reset to the configured %.1f%% by an operator",
            self.model,
            namespace,
            state.percent,
        )
        return answer
