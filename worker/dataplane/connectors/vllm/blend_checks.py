"""The quality guard of fragment reuse on a vLLM node, the worker half's part: a sampled blended load
is judged off the requests' path, on a thread of the worker, by computing the whole prompt twice
over vLLM's model (`blend_model`): by a full prefill, and blended from the same fragments at the
same r (the load's tokens selectively recomputed, the rest computed in full, as vLLM computes it
over the assembled pages). Whether the two choose the same first token, and their KL, go back in
the step reports to the scheduler half, whose tuner raises r or falls back to prefix reuse
(`blend.tuner`).

At most `depth` samples wait; one offered past that is dropped and counted
(`blend.samples_dropped`), so a busy node never queues work without bound.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading

import torch

from worker.dataplane.blend.fusion import BlendPlan, blend_prefill
from worker.dataplane.blend.tuner import agreement
from worker.dataplane.connectors.vllm.blend_model import VllmBlendModel
from worker.dataplane.counters import Counters

log = logging.getLogger("strata.blend")


@dataclasses.dataclass(frozen=True)
class Sample:
    """A blended load to judge: its namespace and r, the whole prompt, the plan it was blended
    with, and the KV it was blended from (`[layers, blocks, 2, block_tokens, kv_heads, head_dim]`,
    on the host)."""

    namespace: str
    percent: float
    prompt: list[int]
    plan: BlendPlan
    prefix: torch.Tensor
    fragments: torch.Tensor


class BlendChecks:
    """Judges sampled blended loads on a thread of their own; `take` hands over the verdicts."""

    def __init__(self, counters: Counters, *, depth: int = 2) -> None:
        self.counters = counters
        self._queue: queue.Queue[tuple[VllmBlendModel, torch.device, Sample] | None] = queue.Queue(maxsize=depth)
        self._lock = threading.Lock()
        self._judged: list[tuple[str, float, bool, float]] = []
        self._busy = 0
        self._idle = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None

    def offer(self, model: VllmBlendModel, device: torch.device, sample: Sample) -> bool:
        """Queue `sample` to be judged; False (and counted) when `depth` samples already wait."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="strata-blend-check", daemon=True)
                self._thread.start()
            self._busy += 1
        try:
            self._queue.put_nowait((model, device, sample))
        except queue.Full:
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()
            self.counters.add("blend.samples_dropped")
            return False
        return True

    def take(self) -> list[tuple[str, float, bool, float]]:
        """The verdicts since the last call: (namespace, r, agreed, KL)."""
        with self._lock:
            judged, self._judged = self._judged, []
        return judged

    def drain(self, timeout: float = 60.0) -> bool:
        """Wait until every queued sample is judged; False if `timeout` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, timeout=timeout)

    def close(self) -> None:
        thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout=30)
            self._thread = None

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            model, device, sample = item
            try:
                verdict = judge(model, sample, device=device)
                with self._lock:
                    self._judged.append(verdict)
            except Exception:  # noqa: BLE001 - a failed check must not stop later ones, nor the engine
                log.exception("blend quality check failed")
                self.counters.add("blend.check_failures")
            finally:
                with self._idle:
                    self._busy -= 1
                    self._idle.notify_all()


def judge(model: VllmBlendModel, sample: Sample, *, device: torch.device) -> tuple[str, float, bool, float]:
    """The whole prompt's last-position logits by full prefill and blended; (namespace, r, agreed, KL)."""
    prefix, fragments = sample.prefix.to(device), sample.fragments.to(device)
    empty = prefix[:, :0]
    full_plan = BlendPlan(prefix_len=0, fragments=[], recompute_ratio=1.0)
    with torch.inference_mode():
        full = blend_prefill(model, sample.prompt, full_plan, lambda layer: (empty[layer], empty[layer]), device=device)
        blended = blend_prefill(
            model, sample.prompt, sample.plan, lambda layer: (prefix[layer], fragments[layer]), device=device
        )
    agree, kl = agreement(blended.logits.float().cpu(), full.logits.float().cpu())
    return sample.namespace, sample.percent, agree, kl
