"""The quality guard of fragment reuse on a vLLM node, the worker half's part: a sampled blended load
is judged by computing the whole prompt twice over vLLM's model (`blend_model`): by a full
prefill, and blended from the same fragments at the same r (the load's tokens selectively
recomputed, the rest computed in full, as vLLM computes it over the assembled pages). Whether the
two choose the same first token, and their KL, go back in the step reports to the scheduler
half, whose tuner raises r or falls back to prefix reuse (`blend.tuner`).

A sample is judged on the worker's own thread at the start of a later step, one per step, before
that step's loads (`judge_pending`), never beside it: vLLM's CPU kernels (its oneDNN matmuls)
abort the process when two threads run them at once, and vLLM's forward pass runs them too. The
cost is that step's: two prefills of the sampled prompt, as on the engine, which serialises its
checks with its requests. At most `depth` samples wait; one offered past that is dropped and
counted (`blend.samples_dropped`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging

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
    """Sampled blended loads waiting to be judged, and the verdicts not yet reported."""

    def __init__(self, counters: Counters, *, depth: int = 2) -> None:
        self.counters = counters
        self.depth = depth
        self._waiting: collections.deque[tuple[VllmBlendModel, torch.device, Sample]] = collections.deque()
        self._judged: list[tuple[str, float, bool, float]] = []

    def offer(self, model: VllmBlendModel, device: torch.device, sample: Sample) -> bool:
        """Keep `sample` to be judged; False (and counted) when `depth` samples already wait."""
        if len(self._waiting) >= self.depth:
            self.counters.add("blend.samples_dropped")
            return False
        self._waiting.append((model, device, sample))
        return True

    def judge_pending(self) -> None:
        """Judge the oldest waiting sample, if any (see the module: on the worker's thread)."""
        if not self._waiting:
            return
        model, device, sample = self._waiting.popleft()
        try:
            self._judged.append(judge(model, sample, device=device))
        except Exception:  # noqa: BLE001 - a failed check must not fail the step, nor later checks
            log.exception("blend quality check failed")
            self.counters.add("blend.check_failures")

    def take(self) -> list[tuple[str, float, bool, float]]:
        """The verdicts since the last call: (namespace, r, agreed, KL)."""
        judged, self._judged = self._judged, []
        return judged


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
