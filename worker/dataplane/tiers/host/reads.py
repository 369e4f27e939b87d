"""The host tier's reads, lock-free and verified: a per-process cache of where keys are, the
generic path (any destination, GPUs included) and the native one (host memory, one call per
attempt); a read that races a writer is retried, a bad copy quarantined."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from typing import cast

import torch

from worker.dataplane import native
from worker.dataplane.checksum import (
    CHECKSUM_BYTES,
    PARALLEL_MIN_BYTES,
    BlockChecksum,
    Span,
    layer_prefixes,
)
from worker.dataplane.errors import BlockCorrupt, BlockMissing
from worker.dataplane.native import READ_BLOCK_SUM, READ_OK, READ_SIZE, READ_TORN, READ_UNSETTLED
from worker.dataplane.tiers.base import ReadResult
from worker.dataplane.tiers.host.key_index import key_words
from worker.dataplane.tiers.host.pool_layout import READY, checksum_of
from worker.dataplane.tiers.host.slots import SlotTable

READ_ATTEMPTS = 16
"""A read retried this many times because writers kept changing the slot is reported as a miss."""


class HostReads(SlotTable):
    """`get`, `get_layers`, `checksum`, `stored_bytes` and `contains` of the host tier (see `reads`)."""

    def get(self, key: uuid.UUID, out: torch.Tensor) -> ReadResult:
        result = self._read([key], range(self.layout.layers), [self._block_bytes(out)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def get_layers(
        self, keys: Sequence[uuid.UUID], layers: int | range | slice, outs: Sequence[torch.Tensor]
    ) -> list[Future[ReadResult]]:
        return self._read_async(self._read, keys, layers, outs)

    def _settled(self, slot: int, key: uuid.UUID) -> int | None:
        """The slot's generation when it holds `key`, READY and not being changed; else None
        (a writer or an eviction is at work: try again)."""
        generation = int(self._gen[slot])
        k0, k1 = key_words(key)
        if generation % 2 or self._state[slot] != READY or self._keys[slot, 0] != k0 or self._keys[slot, 1] != k1:
            return None
        return generation

    def _layer_sums(self, slot: int, layers: range) -> list[bytes]:
        """The stored checksums of `layers` of the block in `slot`, one 16-byte digest each."""
        stored = self._sums[slot, layers.start : layers.stop].tobytes()
        return [stored[j : j + CHECKSUM_BYTES] for j in range(0, len(stored), CHECKSUM_BYTES)]

    def _find(self, key: uuid.UUID) -> int | None:
        slot = self._lookup.get(key)
        if slot is not None:
            k0, k1 = key_words(key)
            if self._keys[slot, 0] == k0 and self._keys[slot, 1] == k1 and self._state[slot] == READY:
                return slot
        found = self._ready_slots(key)
        if not found:
            self._lookup.pop(key, None)
            return None
        if len(self._lookup) > 4 * self.slots:
            self._lookup.clear()  # entries of blocks other processes evicted pile up otherwise
        slot = found[0]
        self._lookup[key] = slot
        return slot

    def _read(self, keys: list[uuid.UUID], layers: range, dsts: list[torch.Tensor]) -> list[ReadResult | Exception]:
        if self.hasher.native and all(dst.device.type == "cpu" for dst in dsts):
            return self._read_native(keys, layers, dsts)
        layout = self.layout
        layer_bytes = layout.layer_bytes
        offset, nbytes = layout.span(layers)
        whole = len(layers) == layout.layers
        results: list[ReadResult | Exception | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        for _attempt in range(READ_ATTEMPTS):
            if not pending:
                break
            retry: list[int] = []
            batch: list[tuple[int, int, int, list[bytes], int, bytes]] = []
            spans: list[Span] = []
            device_copies: list[tuple[torch.Tensor, torch.Tensor]] = []
            host_copies: list[tuple[torch.Tensor, torch.Tensor]] = []
            # Copy and hash chunk by chunk on the hasher's threads (the fused routine does it in
            # one pass at any size). Without it, small batches take one torch copy, then one
            # hash in this thread (a thread hand-off would cost more).
            fused = self.hasher.native or len(pending) * nbytes >= PARALLEL_MIN_BYTES
            for i in pending:
                key = keys[i]
                slot = self._find(key)
                if slot is None:
                    results[i] = BlockMissing(key, tier=self.name)
                    continue
                generation = self._settled(slot, key)
                if generation is None:
                    retry.append(i)
                    continue
                want = self._layer_sums(slot, layers)
                stored_nbytes = int(self._nbytes[slot])
                block_sum = self._block_sums[slot].tobytes()
                batch.append((i, slot, generation, want, stored_nbytes, block_sum))
                src = self._slot_address(slot) + offset
                dst = dsts[i]
                start = slot * self.slot_bytes + offset
                if dst.device.type != "cpu":
                    # Hash the pool's bytes while the GPU copies them: the generation check
                    # after both proves they were the same bytes.
                    device_copies.append((dst, self._data[start : start + nbytes]))
                    hash_at, copy_to = src, None
                elif fused:
                    hash_at, copy_to = src, dst.data_ptr()
                else:
                    host_copies.append((dst, self._data[start : start + nbytes]))
                    hash_at, copy_to = dst.data_ptr(), None
                spans += [
                    Span(
                        hash_at + j * layer_bytes,
                        layer_bytes,
                        prefix,
                        None if copy_to is None else copy_to + j * layer_bytes,
                    )
                    for j, prefix in enumerate(layer_prefixes(key, layers))
                ]
            streams = self._copy_to_devices(device_copies)
            for dst, src_view in host_copies:
                dst.copy_(src_view)  # torch's own threads; the hash below reads the copy
            digests = self.hasher.run(spans)
            for stream in streams:
                stream.synchronize()
            cursor = 0
            for i, slot, generation, want, stored_nbytes, block_sum in batch:
                got = digests[cursor : cursor + len(layers)]
                cursor += len(layers)
                if int(self._gen[slot]) != generation:
                    # A writer or an eviction touched the slot during the copy: discard, retry.
                    self.counters.add(f"{self.name}.torn_retries")
                    retry.append(i)
                    continue
                bad = next((layer for layer, g, w in zip(layers, got, want, strict=True) if g != w), None)
                if stored_nbytes != layout.block_bytes:
                    results[i] = self._quarantine(keys[i], slot, generation, f"slot records {stored_nbytes} bytes")
                elif bad is None:
                    self.counters.add(f"{self.name}.hits")
                    self.counters.add(f"{self.name}.bytes_read", nbytes)
                    checksum = BlockChecksum(block=block_sum, layers=tuple(want)) if whole else None
                    if checksum is not None and not checksum.consistent(keys[i]):
                        results[i] = self._quarantine(
                            keys[i], slot, generation, "block checksum does not match its layers"
                        )
                        continue
                    results[i] = ReadResult(
                        key=keys[i], tier=self.name, layers=layers, nbytes=nbytes, checksum=checksum
                    )
                else:
                    results[i] = self._quarantine(keys[i], slot, generation, f"layer {bad} checksum mismatch")
            pending = retry
        return self._finish_read(keys, results, pending)

    def _read_native(
        self, keys: list[uuid.UUID], layers: range, dsts: list[torch.Tensor]
    ) -> list[ReadResult | Exception]:
        """`_read` into host memory in one native call per attempt (`native.pool_read`): the
        same checks in the same order (slot stable and holding the key, copy and hash, generation
        unchanged, recorded size, layer checksums, block checksum), without the interpreter's
        cost per block and per layer."""
        layout = self.layout
        nbytes = len(layers) * layout.layer_bytes
        whole = len(layers) == layout.layers
        results: list[ReadResult | Exception | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        cached = self._lookup
        hits = 0
        for attempt in range(READ_ATTEMPTS):
            if not pending:
                break
            asked: list[int] = []
            slots: list[int] = []
            for i in pending:
                # First from this process's cache, unchecked (the native call checks the slot
                # itself); a retry looks the key up afresh.
                slot = cached.get(keys[i]) if attempt == 0 else None
                if slot is None:
                    slot = self._find(keys[i])
                    if slot is None:
                        results[i] = BlockMissing(keys[i], tier=self.name)
                        continue
                asked.append(i)
                slots.append(slot)
            if not asked:
                pending = []
                break
            spans = len(slots) * len(layers)
            mode = self.hasher.copy_mode(spans, spans * layout.layer_bytes)
            statuses, generations, sums, block_sums = native.pool_read(
                self._pool_geometry,
                slots,
                b"".join(keys[i].bytes for i in asked),
                [dsts[i].data_ptr() for i in asked],
                layers.start,
                len(layers),
                streaming=mode.streaming,
                helpers=mode.helpers,
            )
            retry: list[int] = []
            for n, (i, slot, status) in enumerate(zip(asked, slots, statuses, strict=True)):
                if status == READ_OK:
                    hits += 1
                    checksum = checksum_of(sums, block_sums, n, layout.layers) if whole else None
                    results[i] = ReadResult(
                        key=keys[i], tier=self.name, layers=layers, nbytes=nbytes, checksum=checksum
                    )
                elif status in (READ_UNSETTLED, READ_TORN):
                    if status == READ_TORN:
                        # A writer or an eviction touched the slot during the copy: discard, retry.
                        self.counters.add(f"{self.name}.torn_retries")
                    retry.append(i)
                else:
                    if status == READ_SIZE:
                        reason = f"slot records {int(self._nbytes[slot])} bytes"
                    elif status == READ_BLOCK_SUM:
                        reason = "block checksum does not match its layers"
                    else:
                        reason = f"layer {status - 1} checksum mismatch"
                    results[i] = self._quarantine(keys[i], slot, generations[n], reason)
            pending = retry
        if hits:
            self.counters.add(f"{self.name}.hits", hits)
            self.counters.add(f"{self.name}.bytes_read", hits * nbytes)
        return self._finish_read(keys, results, pending)

    def _finish_read(
        self,
        keys: list[uuid.UUID],
        results: list[ReadResult | Exception | None],
        contended: list[int],
    ) -> list[ReadResult | Exception]:
        """The reads writers kept changing (`contended`, out of attempts) become misses; misses
        are counted."""
        for i in contended:
            self.counters.add(f"{self.name}.contended")
            results[i] = BlockMissing(keys[i], tier=self.name)
        misses = sum(isinstance(result, BlockMissing) for result in results)
        if misses:
            self.counters.add(f"{self.name}.misses", misses)
        return cast(list[ReadResult | Exception], results)

    def _copy_to_devices(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.cuda.Stream]:
        """Queue pool-to-GPU copies on this tier's stream per device (the pool is pinned, so they
        run while the CPU hashes the same bytes); returns the streams to wait on."""
        used: dict[torch.device, torch.cuda.Stream] = {}
        for dst, src in copies:
            stream = self._streams.get(dst.device)
            if stream is None:
                stream = self._streams[dst.device] = torch.cuda.Stream(dst.device)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            used[dst.device] = stream
        return list(used.values())

    def _quarantine(self, key: uuid.UUID, slot: int, generation: int, reason: str) -> BlockCorrupt:
        self.counters.add(f"{self.name}.corrupt")
        with self._locked():
            # Only this copy: a writer may have stored a good one under the key meanwhile.
            if int(self._gen[slot]) == generation and self._state[slot] == READY:
                self._release(slot)
                self.counters.add(f"{self.name}.quarantined")
        return BlockCorrupt(key, tier=self.name, reason=reason)

    def checksum(self, key: uuid.UUID) -> BlockChecksum:
        """The checksum stored with a block (from its slot; the data is not read). Read between
        two looks at the slot's generation, so a writer or an eviction meanwhile is never mixed in."""
        for _attempt in range(READ_ATTEMPTS):
            slot = self._find(key)
            if slot is None:
                break
            generation = self._settled(slot, key)
            if generation is None:
                continue
            layers = self._layer_sums(slot, range(self.layout.layers))
            block_sum = self._block_sums[slot].tobytes()
            if int(self._gen[slot]) == generation:
                return BlockChecksum(block=block_sum, layers=tuple(layers))
        raise BlockMissing(key, tier=self.name)

    def stored_bytes(self, key: uuid.UUID) -> bytes | None:
        """The slot's data bytes as stored (the recorded size of them), copied between two looks
        at its generation so a writer or an eviction meanwhile is never mixed in."""
        for _attempt in range(READ_ATTEMPTS):
            slot = self._find(key)
            if slot is None:
                return None
            generation = self._settled(slot, key)
            if generation is None:
                continue
            start = slot * self.slot_bytes
            nbytes = min(int(self._nbytes[slot]), self.slot_bytes)
            data = bytes(self._data[start : start + nbytes].numpy())
            if int(self._gen[slot]) == generation:
                return data
        return None

    def contains(self, key: uuid.UUID) -> bool:
        return self._find(key) is not None
