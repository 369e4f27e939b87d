"""Tensor and pipeline parallel: how one rank's KV relates to Strata's blocks.

A block holds every kv head of every layer: the model's KV, whatever the sharding, so blocks
written at one tensor- or pipeline-parallel size serve a server of any other. vLLM shards a
layer's kv heads evenly across the tensor-parallel ranks (rank r of n holds heads
[r * H / n, (r + 1) * H / n)), and replicates them when n exceeds the model's H (each head on
n / H consecutive ranks); a pipeline stage holds a contiguous run of the layers.

Loads: every rank reads its stage's layers of the hit blocks and scatters its own heads' share
into its pages. Saves: every rank copies its share of each block the step completes inside the
step (the pages may be another request's once the step ends); its save queue's thread then
takes part in one gather, over a process group of the connector's own, which brings every
rank's share to the first rank; that rank assembles, stores and registers the whole block (one
writer, one registration, as at one rank). The gathers run outside the engine step: a pipeline
stage must not wait on another inside it (the next stage's step starts only when this one has
handed its activations on, after the step's end), and the step does not wait for the copies to
travel. Every rank hands its queue the same gathers in the same order (the step's saves are the
same on every rank), whatever its own copies did.
The scheduler's lookup stays one per request: it runs in the engine's process, above the ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from worker.dataplane.buffers import tensor_bytes
from worker.dataplane.layout import BlockLayout

Gather = Callable[[torch.Tensor], "list[torch.Tensor] | None"]
"""Collects one tensor of the same shape from every rank of the model (tensor-parallel ranks
within a stage, stage after stage): on the first rank, the list of them in that order; on the
others, None. Every rank must call it, with the same shape, in the same order of steps."""


@dataclasses.dataclass(frozen=True)
class Shard:
    """The kv heads one tensor-parallel rank holds of each layer of its pipeline stage."""

    rank: int
    ranks: int
    """The tensor-parallel rank and size."""
    kv_heads: int
    """The model's kv heads (every rank's share together)."""
    stage: int = 0
    stages: tuple[tuple[int, int], ...] = ()
    """Each pipeline stage's layers [first, end), in stage order; empty: one stage, every layer."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.ranks:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside 0..{self.ranks - 1}")
        if self.kv_heads >= self.ranks and self.kv_heads % self.ranks:
            raise ValueError(
                f"{self.kv_heads} kv heads cannot be split evenly across {self.ranks} tensor-parallel ranks"
            )
        if self.kv_heads < self.ranks and self.ranks % self.kv_heads:
            raise ValueError(f"{self.ranks} tensor-parallel ranks cannot replicate {self.kv_heads} kv heads evenly")
        if self.stages and not 0 <= self.stage < len(self.stages):
            raise ValueError(f"pipeline stage {self.stage} is outside 0..{len(self.stages) - 1}")

    @property
    def heads(self) -> int:
        """How many kv heads this rank holds."""
        return max(1, self.kv_heads // self.ranks)

    @property
    def first(self) -> int:
        """The first kv head this rank holds."""
        return self.first_of(self.rank)

    def first_of(self, rank: int) -> int:
        return rank * self.kv_heads // self.ranks

    @property
    def whole(self) -> bool:
        """One rank holding every head of every layer: nothing to split or gather."""
        return self.ranks == 1 and len(self.stages) <= 1

    @property
    def world(self) -> int:
        """Ranks holding a share of the model: tensor-parallel ranks times pipeline stages."""
        return self.ranks * max(1, len(self.stages))

    def layers(self, block: BlockLayout, stage: int | None = None) -> range:
        """The layers a stage holds (this rank's by default)."""
        if not self.stages:
            return range(block.layers)
        first, end = self.stages[self.stage if stage is None else stage]
        return range(first, end)

    def local(self, layer: int, block: BlockLayout) -> int:
        """A layer's place among this stage's layers (its index in the rank's pages)."""
        return layer - self.layers(block).start

    def layout(self, block: BlockLayout, stage: int | None = None) -> BlockLayout:
        """The layout of a rank's share of a block (its heads of its stage's layers, every token)."""
        if block.kv_heads != self.kv_heads:
            raise ValueError(f"the block holds {block.kv_heads} kv heads, the shard was cut from {self.kv_heads}")
        if self.stages and self.stages[-1][1] != block.layers:
            raise ValueError(f"the block holds {block.layers} layers, the stages end at {self.stages[-1][1]}")
        return dataclasses.replace(block, kv_heads=self.heads, layers=len(self.layers(block, stage)))

    def share_bytes(self, block: BlockLayout) -> int:
        """Bytes of the largest share of any rank (the size every rank's share is gathered at)."""
        return max(self.layout(block, stage).block_bytes for stage in range(max(1, len(self.stages))))

    def share(self, blocks: torch.Tensor) -> torch.Tensor:
        """This rank's heads of typed block data whose last two axes are [kv_heads, head_dim] (a
        view)."""
        return blocks if self.whole else blocks[..., self.first : self.first + self.heads, :]

    def assemble(self, layout: BlockLayout, block: torch.Tensor, shares: Sequence[torch.Tensor]) -> None:
        """Write a whole block's bytes from every rank's share (in the gather's order: the
        tensor-parallel ranks of stage 0, then of stage 1, ...; each starting with the bytes of
        that rank's `layout`). Replicated heads come from the first rank that holds them."""
        if len(shares) != self.world:
            raise ValueError(f"a block needs the shares of {self.world} ranks, got {len(shares)}")
        typed = tensor_bytes(block).view(layout.dtype).view(layout.layers, 2, *layout.kv_shape)
        done = set()
        for index, data in enumerate(shares):
            stage, rank = divmod(index, self.ranks)
            first = self.first_of(rank)
            if (stage, first) in done:
                continue
            done.add((stage, first))
            part = self.layout(layout, stage)
            layers = self.layers(layout, stage)
            share = tensor_bytes(data)[: part.block_bytes].view(layout.dtype).view(part.layers, 2, *part.kv_shape)
            typed[layers.start : layers.stop, ..., first : first + self.heads, :].copy_(share)


def model_shard(kv_heads: int, layers: int) -> tuple[Shard, Gather | None]:
    """This worker's shard of vLLM's tensor- and pipeline-parallel groups, and the gather over
    every rank of the model (None at one rank): a gloo group of the connector's own, so that its
    gathers, run on the save queue's thread, never meet vLLM's collectives on a group of vLLM's."""
    import datetime

    from vllm.distributed.parallel_state import get_pp_group, get_tp_group, get_world_group
    from vllm.distributed.utils import get_pp_indices

    tp, pp = get_tp_group(), get_pp_group()
    stages = (
        tuple(get_pp_indices(layers, stage, pp.world_size) for stage in range(pp.world_size))
        if pp.world_size > 1
        else ()
    )
    shard = Shard(rank=tp.rank_in_group, ranks=tp.world_size, kv_heads=kv_heads, stage=pp.rank_in_group, stages=stages)
    if shard.whole:
        return shard, None
    ranks = list(get_world_group().ranks)  # tensor-parallel rank innermost, then the stage: the gather's order
    if len(ranks) != shard.world:
        raise ValueError(f"the model's {shard.world} ranks are not vLLM's world of {len(ranks)}")
    group = torch.distributed.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(minutes=5))
    first = ranks[0]
    me = torch.distributed.get_rank()

    def gather(tensor: torch.Tensor) -> list[torch.Tensor] | None:
        parts = [torch.empty_like(tensor) for _ in ranks] if me == first else None
        torch.distributed.gather(tensor, parts, dst=first, group=group)
        return parts

    return shard, gather
