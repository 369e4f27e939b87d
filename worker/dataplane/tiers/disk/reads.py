"""The disk tier's reads, every one verified: a whole block split between the calling thread and
the I/O threads, a block read in pieces hashed while the next is read, the same layers of many
blocks in one native call, and reads into GPU memory through kvikio where it is present."""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from typing import NamedTuple

import torch

from worker.dataplane import native
from worker.dataplane.buffers import host_view, is_aligned
from worker.dataplane.checksum import BlockChecksum, layer_prefix
from worker.dataplane.tiers.base import ReadResult
from worker.dataplane.tiers.disk.files import BlockFiles
from worker.dataplane.tiers.disk.gds import kvikio_read
from worker.dataplane.tiers.disk.headers import Header, Stamp

SPLIT_PIECE_BYTES = 1024 * 1024
"""A single large block read (`get`) is read in pieces of this many bytes by the calling thread
and the tier's I/O threads together, each hashing a piece right after reading it, while its bytes
are still in the CPU cache: hashing cold memory costs more than the whole read's CPU, and with
fewer, larger pieces the device idles while a thread hashes. Read this way a block comes in at
about the speed of one raw read of it (benchmarks/README.md)."""
READ_PIECE_BYTES = 8 * 1024 * 1024
"""A block read into host memory is read in pieces of this many bytes (whole layers), each hashed
while the next is read. Smaller pieces hide more of the hash but make more, shorter reads."""


class _Opened(NamedTuple):
    """A block file opened for a batched layer read (`DiskTier._read_batch`)."""

    position: int
    """The item's place in the batch (its future's index)."""
    key: uuid.UUID
    dst: torch.Tensor
    fd: int
    stamp: Stamp
    header: Header
    direct: bool


class DiskReads(BlockFiles):
    """`get`, `get_layers`, `checksum` and `stored_bytes` of the disk tier (see `reads`)."""

    def get(self, key: uuid.UUID, out: torch.Tensor) -> ReadResult:
        dst = self._block_bytes(out)
        return self._read(key, range(self.layout.layers), dst, split=True)

    def get_layers(
        self, keys: Sequence[uuid.UUID], layers: int | range | slice, outs: Sequence[torch.Tensor]
    ) -> list[Future[ReadResult]]:
        """One task per I/O thread, each reading its share of the blocks one after another (the
        threads keep that many reads in flight): a hand-off per share, not per block, which
        matters for the many small reads of layer-wise loading."""
        selected = self.layout.layer_range(layers)
        dsts = self._layer_outs(selected, keys, outs)
        futures: list[Future[ReadResult]] = [Future() for _ in keys]
        shares = max(1, min(self.io_threads, len(keys)))

        def run(share: int) -> None:
            for i in range(share, len(keys), shares):
                try:
                    futures[i].set_result(self._read(keys[i], selected, dsts[i]))
                except BaseException as exc:  # noqa: BLE001 - handed to that block's future
                    futures[i].set_exception(exc)

        def run_batched(share: int) -> None:
            self._read_batch([(i, keys[i], dsts[i]) for i in range(share, len(keys), shares)], selected, futures)

        batched = (
            native.available()
            and self.layout.span(selected)[1] <= READ_PIECE_BYTES
            and all(dst.device.type == "cpu" for dst in dsts)
        )
        for share in range(shares if keys else 0):
            self._submit(run_batched if batched else run, share)
        return futures

    def _read_batch(
        self,
        items: Sequence[tuple[int, uuid.UUID, torch.Tensor]],
        layers: range,
        futures: Sequence[Future[ReadResult]],
    ) -> None:
        """Read the same `layers` of many blocks into host buffers, setting `futures[i]` for each
        item (i, key, destination): the files are opened and their headers recalled here, then
        every read and its hash runs in one native call without the interpreter lock (the many
        small reads of layer-wise loading would otherwise each take several interpreter steps,
        contending with the model's own thread), then each block is verified on its own: a
        missing, short or corrupt block fails only its future."""
        layout = self.layout
        offset, nbytes = layout.span(layers)
        file_offset = self.header_bytes + offset
        opened: list[_Opened] = []
        try:
            for i, key, dst in items:
                direct = self.direct_io and is_aligned(dst.data_ptr(), nbytes, file_offset)
                try:
                    fd, stamp = self._open_for_read(key, direct=direct)
                except BaseException as exc:  # noqa: BLE001 - that block's future fails
                    futures[i].set_exception(exc)
                    continue
                try:
                    if stamp.size < self.file_bytes:
                        raise self._corrupt(key, f"file is {stamp.size} bytes, a block file is {self.file_bytes}")
                    header = self._headers.recall(key, stamp) or self._read_header(fd, key)
                except BaseException as exc:  # noqa: BLE001 - that block's future fails
                    os.close(fd)
                    futures[i].set_exception(exc)
                    continue
                opened.append(_Opened(i, key, dst, fd, stamp, header, direct))
            if not opened:
                return
            got, sums = native.ReadBatch(
                [entry.fd for entry in opened],
                [file_offset] * len(opened),
                [entry.dst.data_ptr() for entry in opened],
                [nbytes] * len(opened),
                layout.layer_bytes,
                [layer_prefix(entry.key, layer) for entry in opened for layer in layers],
            ).read()
        except BaseException as exc:  # noqa: BLE001 - no read was verified: every future fails
            for entry in opened:
                os.close(entry.fd)
                futures[entry.position].set_exception(exc)
            return
        for j, entry in enumerate(opened):
            try:
                if not entry.direct:
                    os.posix_fadvise(entry.fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(entry.fd)
                self._check_read(entry.key, got[j], nbytes)
                self.counters.add(f"{self.name}.io_{'direct' if entry.direct else 'buffered'}")
                got_sums = sums[j * len(layers) : (j + 1) * len(layers)]
                futures[entry.position].set_result(
                    self._verified(entry.key, layers, entry.stamp, entry.header, got_sums)
                )
            except BaseException as exc:  # noqa: BLE001 - that block's future fails
                futures[entry.position].set_exception(exc)

    def _read(self, key: uuid.UUID, layers: range, dst: torch.Tensor, *, split: bool = False) -> ReadResult:
        """Read and verify `layers` of a block into `dst`. `split` (a caller outside the tier's
        I/O threads, reading one block) lets the I/O threads share a large read with it."""
        layout = self.layout
        offset, nbytes = layout.span(layers)
        on_gpu = dst.device.type != "cpu"
        host_dst = dst if not on_gpu else self._staging(nbytes)
        file_offset = self.header_bytes + offset
        direct = self.direct_io and is_aligned(host_dst.data_ptr(), nbytes, file_offset)
        fd, stamp = self._open_for_read(key, direct=direct)
        hashing: list[Future[list[bytes]]] | None = None
        split_sums: list[bytes] | None = None
        try:
            if stamp.size < self.file_bytes:
                raise self._corrupt(key, f"file is {stamp.size} bytes, a block file is {self.file_bytes}")
            header = self._headers.recall(key, stamp)
            if on_gpu and self._kvikio is not None:
                if header is None:
                    header = self._read_header(fd, key)
                got = kvikio_read(self._kvikio, self.path_of(key), dst, nbytes, file_offset)
                if got != nbytes:
                    raise self._corrupt(key, f"short read of {got} bytes")
                host_dst.copy_(dst)  # verification needs the bytes on the host
            elif split and native.available() and nbytes >= 2 * SPLIT_PIECE_BYTES:
                header = header or self._read_header(fd, key)
                split_sums = self._read_split(fd, key, host_dst, layers, file_offset)
            else:
                header, hashing = self._read_hashing(fd, key, host_dst, layers, header)
            if not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            kind = "kvikio" if on_gpu and self._kvikio is not None else "direct" if direct else "buffered"
            self.counters.add(f"{self.name}.io_{kind}")
        finally:
            os.close(fd)
        if hashing is not None:
            got_sums = [digest for piece in hashing for digest in piece.result()]
        elif split_sums is not None:
            got_sums = split_sums
        else:
            got_sums = self.hasher.run(self._spans(key, host_dst, layers))
        result = self._verified(key, layers, stamp, header, got_sums)
        if on_gpu and self._kvikio is None:
            dst.copy_(host_dst)
        return result

    def _verified(
        self,
        key: uuid.UUID,
        layers: range,
        stamp: Stamp,
        header: Header,
        got_sums: Sequence[bytes],
    ) -> ReadResult:
        """Check the hashes of `layers` just read against the header's (a mismatch quarantines
        the block and raises BlockCorrupt), remember the header, count the hit."""
        self._verify(key, layers, got_sums, header.checksum.layers[layers.start : layers.stop])
        self._headers.remember(key, stamp, header)
        nbytes = len(layers) * self.layout.layer_bytes
        self.counters.add(f"{self.name}.hits")
        self.counters.add(f"{self.name}.bytes_read", nbytes)
        return ReadResult(
            key=key,
            tier=self.name,
            layers=layers,
            nbytes=nbytes,
            checksum=header.checksum if len(layers) == self.layout.layers else None,
            stored=header.checksum,
        )

    def _read_hashing(
        self, fd: int, key: uuid.UUID, dst: torch.Tensor, layers: range, header: Header | None
    ) -> tuple[Header, list[Future[list[bytes]]]]:
        """Read `layers` into `dst` a piece at a time, each piece hashed on the hasher's
        other thread while the next one is read, the last one on this thread (nothing is left to
        read meanwhile): verifying costs little more than the hash of the last piece. The header
        comes with the first piece when it is not known yet."""
        layout = self.layout
        size = layout.layer_bytes
        offset, _nbytes = layout.span(layers)
        view = host_view(dst)
        hashing: list[Future[list[bytes]]] = []
        try:
            for first, count in _pieces(len(layers), max(1, -(-READ_PIECE_BYTES // size)), alone=1):
                piece = view[first * size : (first + count) * size]
                at = self.header_bytes + offset + first * size
                if header is None and first == 0 and offset == 0:
                    hdr = self._header_buffer()  # header and first piece in one syscall
                    got = self._pread_exact(fd, [host_view(hdr), piece], 0)
                    if got != self.header_bytes + len(piece):
                        raise self._corrupt(key, f"short read of {got} bytes")
                    header = self._parse_header(key, host_view(hdr))
                else:
                    if header is None:
                        header = self._read_header(fd, key)
                    got = self._pread_exact(fd, [piece], at)
                    if got != len(piece):
                        raise self._corrupt(key, f"short read of {got} bytes")
                spans = self._spans(key, dst[first * size :], layers[first : first + count])
                if first + count >= len(layers):  # the last piece: nothing left to overlap its hash with
                    done: Future[list[bytes]] = Future()
                    done.set_result(self.hasher.run(spans))
                    hashing.append(done)
                else:
                    hashing.append(self.hasher.run_async(spans))
        except BaseException:
            for pending in hashing:  # never leave a thread reading a buffer the caller may free
                pending.exception()
            raise
        assert header is not None
        return header, hashing

    def _read_split(self, fd: int, key: uuid.UUID, dst: torch.Tensor, layers: range, file_offset: int) -> list[bytes]:
        """Read `layers` into `dst` in pieces of SPLIT_PIECE_BYTES, shared between this thread
        and the tier's I/O threads as they go (each takes the next piece when it is done with its
        last, through a counter in the native reader), each piece hashed by the thread that read
        it as soon as it lands, one native call per thread without the interpreter lock: several
        reads stay in flight while any thread hashes, and the hash reads cached bytes. The last
        two layers are pieces of their own, so the threads finish within a layer's hash of each
        other. Returns the layer hashes in layer order."""
        size = self.layout.layer_bytes
        pieces = _pieces(len(layers), max(1, SPLIT_PIECE_BYTES // size), alone=2)
        base = dst.data_ptr()
        batch = native.ReadBatch(
            [fd] * len(pieces),
            [file_offset + first * size for first, _count in pieces],
            [base + first * size for first, _count in pieces],
            [count * size for _first, count in pieces],
            size,
            [layer_prefix(key, layer) for layer in layers],
        )
        helpers = [self._submit(batch.run) for _ in range(max(1, min(self.io_threads, len(pieces)) - 1))]
        try:
            batch.run()
        finally:
            for helper in helpers:
                helper.exception()  # never return (and let the caller free dst) while it still reads
        for helper in helpers:
            helper.result()
        got, sums = batch.results()
        for (_first, count), n in zip(pieces, got, strict=True):
            self._check_read(key, n, count * size)
        return sums

    def _check_read(self, key: uuid.UUID, got: int, want: int) -> None:
        """Raise for a native read that failed (`got` is -errno) or came short (the file is
        shorter than its block: corrupt, quarantined)."""
        if got < 0:
            raise OSError(-got, os.strerror(-got), str(self.path_of(key)))
        if got != want:
            raise self._corrupt(key, f"short read of {got} bytes")

    def _read_header(self, fd: int, key: uuid.UUID) -> Header:
        hdr = self._header_buffer()
        got = self._pread_exact(fd, [host_view(hdr)], 0)
        if got != self.header_bytes:
            raise self._corrupt(key, f"short header read of {got} bytes")
        return self._parse_header(key, host_view(hdr))

    def checksum(self, key: uuid.UUID) -> BlockChecksum:
        """The stored checksum of a block (from its header; the data is not read)."""
        fd, stamp = self._open_for_read(key, direct=self.direct_io)
        try:
            header = self._headers.recall(key, stamp) or self._read_header(fd, key)
        finally:
            os.close(fd)
        return header.checksum

    def stored_bytes(self, key: uuid.UUID) -> bytes | None:
        """The file's data bytes (after the header; the alignment padding of a full-size file
        left out), read with plain buffered I/O apart from the tier's read paths."""
        try:
            with open(self.path_of(key), "rb") as f:
                f.seek(self.header_bytes)
                data = f.read()
        except FileNotFoundError:
            return None
        if len(data) == self.file_bytes - self.header_bytes:
            return data[: self.layout.block_bytes]
        return data


def _pieces(layers: int, per_piece: int, alone: int) -> list[tuple[int, int]]:
    """(first layer, layer count) of each read of `layers` layers: pieces of `per_piece` layers,
    the last `alone` layers (fewer if there are not more than that many) each a piece of its own,
    so that what is left to hash after the last reads is one layer's."""
    body = max(layers - alone, 1 if layers else 0)
    pieces = [(first, min(per_piece, body - first)) for first in range(0, body, per_piece)]
    return pieces + [(first, 1) for first in range(body, layers)]
