"""Tensor parallel: how one rank's KV relates to Strata's blocks.

A block holds every kv head of every layer: the model's KV, whatever the sharding, so blocks
written at one tensor-parallel size serve a server of any other size. vLLM shards a layer's kv
heads evenly across the ranks (rank r of n holds heads [r * H / n, (r + 1) * H / n)), and
replicates them when n exceeds the model's H (each head on n / H consecutive ranks).

Loads: every rank reads the hit blocks' layers and scatters its own heads' share into its
pages. Saves: every rank copies its share of each block the step completes into one buffer,
and one gather over vLLM's tensor-parallel group brings every rank's share to the first rank,
which stores and registers the whole block (one writer, one registration, as at one rank).
(The gather is an all-gather on vLLM's CPU group: see `tensor_parallel_shard`.)
The scheduler's lookup stays one per request: it runs in the engine's process, above the ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from worker.dataplane.buffers import tensor_bytes
from worker.dataplane.layout import BlockLayout

Gather = Callable[[torch.Tensor], "list[torch.Tensor] | None"]
"""Collects one tensor of the same shape from every rank: on the first rank, the list of them in
rank order; on the others, None. Every rank must call it, with the same shape, in the same step."""


@dataclasses.dataclass(frozen=True)
class Shard:
    """The kv heads one tensor-parallel rank holds of each layer."""

    rank: int
    ranks: int
    kv_heads: int
    """The model's kv heads (every rank's share together)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.ranks:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside 0..{self.ranks - 1}")
        if self.kv_heads >= self.ranks and self.kv_heads % self.ranks:
            raise ValueError(
                f"{self.kv_heads} kv heads cannot be split evenly across {self.ranks} tensor-parallel ranks"
            )
        if self.kv_heads < self.ranks and self.ranks % self.kv_heads:
            raise ValueError(f"{self.ranks} tensor-parallel ranks cannot replicate {self.kv_heads} kv heads evenly")

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
        """One rank holding every head: nothing to split or gather."""
        return self.ranks == 1

    def layout(self, block: BlockLayout) -> BlockLayout:
        """The layout of this rank's share of a block (its heads, every layer and token)."""
        if block.kv_heads != self.kv_heads:
            raise ValueError(f"the block holds {block.kv_heads} kv heads, the shard was cut from {self.kv_heads}")
        return dataclasses.replace(block, kv_heads=self.heads)

    def share(self, blocks: torch.Tensor) -> torch.Tensor:
        """This rank's heads of typed block data whose last two axes are [kv_heads, head_dim] (a
        view)."""
        return blocks if self.whole else blocks[..., self.first : self.first + self.heads, :]

    def assemble(self, layout: BlockLayout, block: torch.Tensor, shares: Sequence[torch.Tensor]) -> None:
        """Write a whole block's bytes from every rank's share (in rank order, each the bytes of
        `layout(layout)`). Replicated heads come from the first rank that holds them."""
        if len(shares) != self.ranks:
            raise ValueError(f"a block needs the shares of {self.ranks} ranks, got {len(shares)}")
        typed = tensor_bytes(block).view(layout.dtype).view(layout.layers, 2, *layout.kv_shape)
        part = self.layout(layout)
        done = set()
        for rank, data in enumerate(shares):
            first = self.first_of(rank)
            if first in done:
                continue
            done.add(first)
            share = tensor_bytes(data).view(layout.dtype).view(part.layers, 2, *part.kv_shape)
            typed[..., first : first + self.heads, :].copy_(share)


def tensor_parallel_shard(kv_heads: int) -> tuple[Shard, Gather | None]:
    """This worker's shard of vLLM's tensor-parallel group, and the gather over that group (None at
    one rank). Shares are host tensors: on a CPU server the group's own gather (shared memory)
    moves them; where the group's device is a GPU, they go over its CPU (gloo) group."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    shard = Shard(rank=group.rank_in_group, ranks=group.world_size, kv_heads=kv_heads)
    if shard.whole:
        return shard, None

    def gather(tensor: torch.Tensor) -> list[torch.Tensor] | None:
        first = group.rank_in_group == 0
        if tensor.device == group.device:
            # vLLM's CPU group: its shared-memory all-gather, the collective vLLM itself runs every
            # step (the logits), on which every rank waits for all (its one-sided gather lets a
            # rank run ahead into the next collective while the first still reads, and both
            # stall). It moves floating-point tensors only: the bytes go as 4- or 2-byte words
            # (a copy, never arithmetic) and come back as they were.
            words = tensor.view(torch.float32 if tensor.shape[-1] % 4 == 0 else torch.bfloat16)
            joined = group.all_gather(words.unsqueeze(0), dim=0)
            return [part.view(tensor.dtype) for part in joined.unbind(0)] if first else None
        parts = [torch.empty_like(tensor) for _ in range(group.world_size)] if first else None
        torch.distributed.gather(tensor, parts, dst=group.ranks[0], group=group.cpu_group)
        return parts

    return shard, gather
