"""Fragment reuse on a vLLM node, the worker half's part: a blended load, assembled whole inside the
step, before vLLM's forward pass reads the request's pages.

The exact prefix comes from the request's pages (what vLLM's prefix cache held) and from the tiers
(Strata's prefix hits), the fragments from the tiers, each block read whole and checked as any
load's are; the selective recompute (`blend.fusion.blend_prefill`) runs over the model vLLM serves
(`blend_model`), and every layer's KV of tokens [start, end) is written into the request's pages,
where vLLM computes the rest of the prompt over it. Anything that fails (a block missing or
corrupt, a model that cannot be blended, an error in the recompute) raises: the worker half
reports the load's pages failed and vLLM recomputes them, so a request is never served
half-assembled.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from worker.dataplane.blend.fusion import BlendPlan, blend_prefill
from worker.dataplane.connectors.pages import PagedKV
from worker.dataplane.connectors.vllm.blend_checks import BlendChecks, Sample
from worker.dataplane.connectors.vllm.blend_model import VllmBlendModel, blend_problem, loaded_model
from worker.dataplane.connectors.vllm.metadata import BlendSpec, LoadSpec
from worker.dataplane.counters import Counters
from worker.dataplane.layout import BlockLayout
from worker.dataplane.store import TieredStore


class BlendUnavailable(RuntimeError):
    """vLLM's model cannot be blended in this process (not noted, or not a shape blending serves)."""


@dataclasses.dataclass
class Blended:
    """What one blended load did."""

    load_s: float
    blocks_by_tier: dict[str, int]
    fragment_tokens: int
    recomputed_tokens: int


class BlendLoads:
    """Runs the blended loads of one worker (one rank: blending serves a single rank)."""

    def __init__(self, store: TieredStore, layout: BlockLayout, counters: Counters, *, verify: bool) -> None:
        self.store = store
        self.layout = layout
        self.counters = counters
        self.verify = verify
        """Copies read from the remote tier must carry the checksum the directory registered."""
        self._model: VllmBlendModel | None = None
        self.checks = BlendChecks(counters)
        """The sampled loads' quality checks (`blend_checks`), judged at the start of later steps."""

    def model(self) -> VllmBlendModel:
        if self._model is None:
            import vllm  # noqa: PLC0415 - the version of the vLLM this process runs

            model = loaded_model()
            if model is None:
                raise BlendUnavailable("vLLM's model is not known to the connector (the Strata plugin did not note it)")
            problem = blend_problem(model, vllm_version=vllm.__version__)
            if problem is not None:
                raise BlendUnavailable(problem)
            self._model = VllmBlendModel(model)
        return self._model

    def run(self, spec: LoadSpec, paged: PagedKV) -> Blended:
        """Assemble tokens [spec.start, spec.end) of the request into its pages (see the module)."""
        blend = spec.blend
        assert blend is not None
        started = time.perf_counter()
        model = self.model()
        size, layers = self.layout.block_tokens, self.layout.layers
        device = paged.device
        count = blend.prefix_len // size
        prefix = torch.empty(layers, count, 2, size, *self.layout.kv_shape[1:], dtype=self.layout.dtype)
        for index in range(count):
            if index not in blend.prefix:  # held by vLLM's own pages
                for layer in range(layers):
                    k, v = prefix[layer, index, 0], prefix[layer, index, 1]
                    paged.gather_layer(layer, k, v, index=index, pages=spec.pages)
        read = [(index, *blend.prefix[index]) for index in sorted(blend.prefix)]
        read += [(-1, f.key, f.tier, f.checksum) for f in blend.fragments]
        blocks = self._read(read)
        for position, (index, *_) in enumerate(read[: len(blend.prefix)]):
            prefix[:, index] = blocks[position]
        fragments = blocks[len(blend.prefix) :].transpose(0, 1) if blend.fragments else prefix[:, :0]
        plan = BlendPlan(
            prefix_len=blend.prefix_len,
            fragments=blend.fragments,
            recompute_ratio=blend.percent / 100.0,
            selection=blend.selection,
            check_layer=blend.check_layer,
        )
        prefix_on, fragments_on = prefix.to(device), fragments.to(device)
        with torch.inference_mode():
            outcome = blend_prefill(
                model, blend.tokens, plan, lambda layer: (prefix_on[layer], fragments_on[layer]), device=device
            )
            self._write(spec, blend, outcome.cache, paged)
        if blend.sample_tokens is not None:
            sample = Sample(spec.namespace, blend.percent, list(blend.sample_tokens), plan, prefix, fragments)
            if self.checks.offer(model, device, sample):
                self.counters.add("blend.samples_queued")
        tiers: dict[str, int] = {}
        for _, _, tier, _ in read:
            tiers[tier] = tiers.get(tier, 0) + 1
        fragment_tokens = size * len(blend.fragments)
        self.counters.add("blend.requests")
        self.counters.add("reused_tokens.fragment", fragment_tokens)
        self.counters.add("blend.recomputed_tokens", outcome.recomputed_tokens)
        return Blended(time.perf_counter() - started, tiers, fragment_tokens, outcome.recomputed_tokens)

    def _read(self, read: list[tuple[int, Any, str, str]]) -> torch.Tensor:
        """The blocks `read` names, whole, as `[blocks, layers, 2, block_tokens, kv_heads, head_dim]`."""
        layers = self.layout.layers
        shape = (len(read), layers, 2, self.layout.block_tokens, *self.layout.kv_shape[1:])
        if not read:
            return torch.empty(shape, dtype=self.layout.dtype)
        buffers = [self.layout.empty() for _ in read]
        futures = self.store.get_layers(
            [key for _, key, _, _ in read],
            layers=range(layers),
            outs=buffers,
            expected=[checksum for _, _, _, checksum in read] if self.verify else None,
        )
        for future in futures:
            future.result()  # BlockMissing / a corrupt copy: the load fails, vLLM recomputes
        return torch.stack(
            [buffer.view(self.layout.dtype).view(layers, 2, *self.layout.kv_shape) for buffer in buffers]
        )

    def _write(self, spec: LoadSpec, blend: BlendSpec, cache: Any, paged: PagedKV) -> None:
        """Every layer's KV of tokens [spec.start, spec.end) into the request's pages."""
        size, n = self.layout.block_tokens, len(blend.tokens)
        whole = -(-n // size) * size
        for layer in range(self.layout.layers):
            keys, values = cache.layer_kv(layer)  # [1, kv_heads, n, head_dim]
            kv = torch.stack([keys[0].transpose(0, 1), values[0].transpose(0, 1)])  # [2, n, kv_heads, head_dim]
            if whole > n:
                kv = torch.cat([kv, kv.new_zeros(2, whole - n, *kv.shape[2:])], dim=1)
            blocks = kv.view(2, whole // size, size, *kv.shape[2:]).transpose(0, 1).contiguous()
            paged.scatter(
                layer, blocks.to(self.layout.dtype), first_block=0, start=spec.start, end=spec.end, pages=spec.pages
            )
