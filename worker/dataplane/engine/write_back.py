"""Write-back: a request's full new blocks, copied out of its KV cache into the write-back tier
(registered in the directory in one batch) and the device working set, and the content index
that fragment matching reads.

    tokens -> fingerprints -> per full block not yet held: copy every layer's tokens into one
    block buffer -> device working set (LRU) and/or the write-back tier (`store_block`, hashed)
    -> register (one batch) + touch the hits

The fingerprints are the ones the request's lookup computed for its prompt: its blocks are stored
under exactly the keys they were looked up by, and only the blocks the generated tokens complete
are fingerprinted here (a long prompt is not hashed twice per request).

A block the request read from L3 is kept in the write-back tier as well (the node's next turn of
the same conversation reads it locally), and is not written back to L3.

With fragment reuse on, blocks aligned to the request's segments (and those after the first
fused fragment) are stored as well, under fragment keys that only a content match finds.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from worker.dataplane.blend.matching import ContentIndex, content_keys_at, fragment_key, segment_windows
from worker.dataplane.directory import BlockRegistration
from worker.dataplane.engine.working_set import WorkingSet
from worker.dataplane.hashing import BlockFingerprint
from worker.dataplane.layout import BlockLayout
from worker.dataplane.offload import OffloadManager
from worker.dataplane.offload_records import Chain, Hit, RequestTrace
from worker.dataplane.prefix.cache import StrataCache
from worker.dataplane.store import TieredStore
from worker.dataplane.tier_names import DEVICE, REMOTE


class BlockWriter:
    """Stores one engine's new blocks: into the offload manager's write-back tier (registered) and,
    with `keep_in_device`, into the device working set."""

    def __init__(
        self,
        *,
        offload: OffloadManager,
        store: TieredStore,
        layout: BlockLayout,
        working_set: WorkingSet | None,
        content_index: ContentIndex,
        keep_in_device: bool,
    ) -> None:
        self.offload = offload
        self.store = store
        self.layout = layout
        self.working_set = working_set
        self.content_index = content_index
        self.keep_in_device = keep_in_device

    def write_back(
        self,
        tokens: list[int],
        hits: list[Hit],
        cache: StrataCache,
        namespace: str,
        trace: RequestTrace,
        *,
        exact_until: int | None = None,
        segments: Sequence[tuple[int, int]] = (),
        fragments_too: bool = False,
        stored_until: int = 0,
        chain: Chain | None = None,
        fingerprints: Sequence[BlockFingerprint] = (),
    ) -> Future[None] | None:
        """Copy full new blocks to the write-back tier (and the device pool) and register them in one batch.

        Only blocks whose KV is exactly what a plain prefill computes (before `exact_until`, the
        first fused fragment) are stored under their prefix keys. With fragment reuse on, blocks
        aligned to the request's segments and the blocks after `exact_until` are also stored,
        under fragment keys that only a content match can find. Blocks ending at or before
        `stored_until` were stored by an earlier write-back of this request and are skipped.

        The blocks are keyed as `chain` says: a shared namespace's leading blocks are that
        namespace's (kept in the device pool at most, never stored or registered as this
        namespace's), and the request's own blocks chain on from them. `fingerprints` are those the
        request's lookup computed for the prompt's blocks under `chain` (`find_prompt`): the
        blocks are stored under exactly those keys, and only blocks past them (the generated
        tokens') are hashed here.

        Returns the future of the batch's write-through to L3 (None when nothing goes there)."""
        fp = self.offload.fingerprinter(namespace)
        blocks = self.offload.fingerprints(tokens, namespace, chain, known=fingerprints)
        lead = len(chain.lead) if chain is not None else 0
        size = self.layout.block_tokens
        model_key = self.offload.model_key
        exact = len(tokens) if exact_until is None else exact_until
        hit_tiers = {h.key: h.tier for h in hits}
        self.offload.note_hits(hits)  # before the stores: they must not evict what they extend
        registrations: list[BlockRegistration] = []
        with torch.inference_mode(False):
            block = self.layout.empty()
        for fingerprint in blocks:
            if fingerprint.start + size > exact:
                break
            if fingerprint.start + size <= stored_until:
                continue
            if fingerprint.index < lead:
                assert chain is not None
                self._keep_shared(fingerprint.prefix_key, fingerprint.start, cache, block, chain.shared, hit_tiers)
                continue
            self.content_index.remember(fingerprint.content_key, fingerprint.prefix_key, fingerprint.start)
            self._store_block(
                fingerprint.prefix_key,
                fingerprint.content_key,
                fingerprint.start,
                cache,
                block,
                namespace,
                trace,
                registrations,
                already=hit_tiers.get(fingerprint.prefix_key),
            )
        if fragments_too:
            offsets = segment_windows(segments, block_tokens=size, limit=len(tokens))
            offsets += [p.start for p in blocks if p.start + size > exact]
            content = content_keys_at(
                tokens, sorted(set(offsets)), ns_salt=fp.ns_salt, model_key=model_key, block_tokens=size
            )
            for offset, key in content.items():
                if key in self.content_index:
                    self.content_index.touch(key)
                    continue  # a copy of these tokens is kept already
                stored = fragment_key(ns_salt=fp.ns_salt, model_key=model_key, content_key=key, position=offset)
                if self._store_block(stored, key, offset, cache, block, namespace, trace, registrations, already=None):
                    self.content_index.remember(key, stored, offset)
        in_remote = {key for key, tier in hit_tiers.items() if tier == REMOTE}
        future = self.offload.register(registrations, in_remote=in_remote)
        self.offload.touch_hits(namespace, hits)
        return future

    def _keep_shared(
        self,
        key: uuid.UUID,
        start: int,
        cache: StrataCache,
        block: torch.Tensor,
        shared: str,
        hit_tiers: dict[uuid.UUID, str],
    ) -> None:
        """A shared namespace's block the request reused: kept in the device pool like the
        request's own (under the shared namespace's priority class), stored nowhere else."""
        if hit_tiers.get(key) == DEVICE:
            self._device_touch(key)
        elif self.keep_in_device and DEVICE in self.store.names and self.offload.target.name != DEVICE:
            self._copy_block(block, cache, start)
            self._device_put(key, block, shared)

    def _store_block(
        self,
        key: uuid.UUID,
        content_key: uuid.UUID,
        start: int,
        cache: StrataCache,
        block: torch.Tensor,
        namespace: str,
        trace: RequestTrace,
        registrations: list[BlockRegistration],
        *,
        already: str | None,
    ) -> bool:
        """Copy tokens [start, start + block) of every layer into `block` and keep it in the write-back
        tier (registered) and the device pool; True if some tier holds it afterwards. A block read
        from L3 (`already` remote) gets a copy in a local write-back tier too."""
        target = self.offload.target
        if already == DEVICE:
            self._device_touch(key)
            return True
        local_copy = already is None or (already == REMOTE and target.name != REMOTE)
        to_target = local_copy and not target.contains(key)
        to_device = self.keep_in_device and target.name != DEVICE and DEVICE in self.store.names
        if not to_target and not to_device:
            return True
        self._copy_block(block, cache, start)
        if to_device:
            self._device_put(key, block, namespace)
        if not to_target:
            return True
        if target.name == DEVICE:
            # L1 is the node's working set, not registered in the directory: LRU within capacity.
            if self._device_put(key, block, namespace):
                trace.written_blocks += 1
            return True
        registration = self.offload.store_block(
            key=key, content_key=content_key, position=start, namespace=namespace, data=block
        )
        if registration is None:
            return to_device
        trace.written_blocks += 1
        registrations.append(registration)
        return True

    def _copy_block(self, block: torch.Tensor, cache: StrataCache, start: int) -> None:
        """Tokens [start, start + block) of every layer of `cache` into `block`."""
        size = self.layout.block_tokens
        for layer, (k_dst, v_dst) in enumerate(self.layout.kv_views(block)):
            keys, values = cache.layer_kv(layer)
            k_dst.copy_(keys[0, :, start : start + size].transpose(0, 1))
            v_dst.copy_(values[0, :, start : start + size].transpose(0, 1))

    def _device_put(self, key: uuid.UUID, block: torch.Tensor, namespace: str) -> bool:
        """Keep a copy in the device pool (the working set evicts least recently used blocks, and
        holds the namespace's priority class to its share)."""
        return self.working_set.put(key, block, namespace=namespace) if self.working_set is not None else False

    def _device_touch(self, key: uuid.UUID) -> None:
        if self.working_set is not None:
            self.working_set.touch(key)
