"""Checksums and the copy+verify hasher agree with plain xxh3-128."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import xxhash
from dataplane_support import SMALL, key, layout_of, make_block

from worker.dataplane import native
from worker.dataplane.buffers import aligned_empty, host_view
from worker.dataplane.checksum import (
    BlockChecksum,
    Hasher,
    Span,
    block_checksum,
    layer_checksum,
    layer_prefix,
)


def test_the_fused_routine_is_built() -> None:
    # `make setup` installs the compiler and header it needs; a silent fallback would make every
    # verified copy slower without anyone noticing.
    assert native.available(), "worker/dataplane/native/copyhash.c was not built"


@pytest.mark.parametrize("fused", [True, False], ids=["native", "python"])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    "sizes",
    [
        [1],
        [4096] * 3,
        [700_001, 3, 2 * 1024 * 1024 + 17],  # misaligned spans above the streaming threshold
        [1024 * 1024] * 9,
        [0, 65_536 * 3 + 1, 255 * 1024],
    ],
)
def test_engine_copy_and_hash_match_xxh3(fused: bool, threads: int, sizes: list[int]) -> None:
    src = torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    spans, offset = [], 0
    for i, n in enumerate(sizes):
        spans.append(
            Span(
                src=src.data_ptr() + offset,
                nbytes=n,
                prefix=b"p%d" % i,
                dst=dst.data_ptr() + offset,
            )
        )
        offset += n
    with Hasher(threads=threads, chunk_bytes=256 * 1024, native=fused) as hasher:
        digests = hasher.run(spans)
        assert torch.equal(src, dst)
        view, offset = host_view(src), 0
        for i, n in enumerate(sizes):
            assert digests[i] == xxhash.xxh3_128(b"p%d" % i + bytes(view[offset : offset + n])).digest()
            offset += n
        # hash only, in place
        hashed = hasher.run([Span(src=s.src, nbytes=s.nbytes, prefix=s.prefix) for s in spans])
        assert hashed == digests
        # copy only
        other = torch.zeros_like(src)
        hasher.run(
            [Span(src=s.src, nbytes=s.nbytes, dst=other.data_ptr() + (s.dst - dst.data_ptr())) for s in spans],
            digest=False,
        )
        assert torch.equal(other, src)


def test_block_checksum_chains_the_layer_checksums(hasher: Hasher) -> None:
    layout = layout_of(SMALL)
    block = make_block(layout, seed=1)
    k = key(1)
    checksum = hasher.checksum(k, block, layout)
    assert isinstance(checksum, BlockChecksum)
    view = host_view(block)
    layers = [
        layer_checksum(k, i, view[i * layout.layer_bytes : (i + 1) * layout.layer_bytes]) for i in range(layout.layers)
    ]
    assert list(checksum.layers) == layers
    assert checksum.block == block_checksum(k, layers) == xxhash.xxh3_128(k.bytes + b"".join(layers)).digest()
    assert checksum.consistent(k) and not checksum.consistent(key(2))
    assert BlockChecksum.unpack(checksum.pack(), layers=layout.layers) == checksum
    # Layer checksums depend on the key and on the layer's position.
    assert layer_prefix(k, 1) != layer_prefix(k, 2)
    assert layer_checksum(k, 0, b"x") != layer_checksum(key(2), 0, b"x") != layer_checksum(k, 1, b"x")


def test_checksum_of_a_layer_range(hasher: Hasher) -> None:
    layout = layout_of(SMALL)
    block = make_block(layout, seed=2)
    whole = hasher.checksum(key(3), block, layout)
    offset, nbytes = layout.span(range(2, 5))
    part = aligned_empty(nbytes)
    part.copy_(block[offset : offset + nbytes])
    assert hasher.checksum(key(3), part, layout, first_layer=2) == list(whole.layers[2:5])


@pytest.mark.parametrize("build", ["sse2", "default"])
def test_each_build_of_the_fused_routine_matches_xxh3(build: str) -> None:
    # The AVX2 build is the default on this CPU; the SSE2 one serves every other x86-64 node.
    script = (
        "import os, xxhash, torch; from worker.dataplane import native\n"
        "src = torch.randint(0, 256, (3_000_017,), dtype=torch.uint8); dst = torch.zeros_like(src)\n"
        "batch = native.CopyBatch([src.data_ptr()], [dst.data_ptr()], [src.numel()], [b'pfx'], digest=True)\n"
        "batch.run(shared=False)\n"
        "got = batch.digests()\n"
        "assert torch.equal(src, dst)\n"
        "assert got == [xxhash.xxh3_128(b'pfx' + src.numpy().tobytes()).digest()]\n"
        "print(native.build())\n"
    )
    env = {**os.environ, "STRATA_NATIVE_COPY": build} if build == "sse2" else dict(os.environ)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    if build == "sse2":
        assert done.stdout.strip() == "sse2"


def test_a_native_copy_batch_refuses_mismatched_lists() -> None:
    with pytest.raises(ValueError, match="one entry per span"):
        native.CopyBatch([1, 2], [None], [1, 1], [b"", b""], digest=True)


@pytest.mark.parametrize("threads", [1, 3])
def test_a_copy_batch_shared_by_threads_does_each_span_once(threads: int) -> None:
    import threading

    sizes = [1024 * 1024 + 5] * 7 + [3, 300_000]
    src = torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    batch = native.CopyBatch(
        [src.data_ptr() + o for o in starts],
        [dst.data_ptr() + o for o in starts],
        sizes,
        [b"s%d" % i for i in range(len(sizes))],
        digest=True,
    )
    workers = [threading.Thread(target=batch.run) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    batch.run()  # a thread arriving after the others finished finds nothing left to claim
    raw = src.numpy().tobytes()
    assert torch.equal(src, dst)
    assert batch.digests() == [
        xxhash.xxh3_128(b"s%d" % i + raw[o : o + n]).digest()
        for i, (o, n) in enumerate(zip(starts, sizes, strict=True))
    ]


def _spans_of(src: torch.Tensor, dst: torch.Tensor, sizes: list[int], tag: bytes):
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    batch = native.CopyBatch(
        [src.data_ptr() + o for o in starts],
        [dst.data_ptr() + o for o in starts],
        sizes,
        [tag + b"%d" % i for i in range(len(sizes))],
        digest=True,
    )
    raw = src.numpy().tobytes()
    want = [
        xxhash.xxh3_128(tag + b"%d" % i + raw[o : o + n]).digest()
        for i, (o, n) in enumerate(zip(starts, sizes, strict=True))
    ]
    return batch, want


def test_the_native_helpers_share_a_batch_with_its_caller() -> None:
    assert native.start_helpers(2) >= 2
    sizes = [256 * 1024] * 63 + [17]
    src = torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8)
    before = native.helper_spans()
    for _attempt in range(50):
        dst = torch.zeros_like(src)
        batch, want = _spans_of(src, dst, sizes, b"h")
        batch.run_with_helpers()
        assert torch.equal(src, dst)
        assert batch.digests() == want
        if native.helper_spans() > before:
            break
    # A helper woke and took spans of a 16 MiB batch (asleep on a futex or still watching).
    assert native.helper_spans() > before


def test_callers_on_several_threads_never_mix_their_batches() -> None:
    import threading

    native.start_helpers(2)
    failures: list[str] = []

    def caller(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        sizes = [65536 + seed] * 16
        src = torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8, generator=generator)
        for round_ in range(60):
            dst = torch.zeros_like(src)
            batch, want = _spans_of(src, dst, sizes, b"c%d-" % seed)
            batch.run_with_helpers()
            if not torch.equal(src, dst) or batch.digests() != want:
                failures.append(f"caller {seed}, round {round_}")

    threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_a_forked_child_copies_with_helpers_of_its_own() -> None:
    # The child of a process whose helpers run (a prefork worker) has none of its threads: its
    # batches run on its own thread until it starts helpers, then on them. (No torch in the
    # child: its OpenMP threads do not survive a fork.)
    import ctypes

    native.start_helpers(1)
    size, count = 128 * 1024, 32
    data = os.urandom(size * count)
    src = ctypes.create_string_buffer(data, len(data))
    base = ctypes.addressof(src)

    def copied(tag: bytes) -> bool:
        dst = ctypes.create_string_buffer(len(data))
        out = ctypes.addressof(dst)
        prefixes = [tag + b"%d" % i for i in range(count)]
        batch = native.CopyBatch(
            [base + i * size for i in range(count)],
            [out + i * size for i in range(count)],
            [size] * count,
            prefixes,
            digest=True,
        )
        batch.run_with_helpers()
        want = [xxhash.xxh3_128(p + data[i * size : (i + 1) * size]).digest() for i, p in enumerate(prefixes)]
        return dst.raw == data and batch.digests() == want

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        code = 1
        try:
            alone = copied(b"f")
            started = native.start_helpers(1) == 1
            code = 0 if alone and started and copied(b"g") else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "cached"])
def test_a_copy_batch_copies_exactly_with_either_kind_of_store(streaming: bool) -> None:
    sizes = [300_001, 5, 1024 * 1024 + 3]
    src = torch.randint(0, 256, (sum(sizes) + 1,), dtype=torch.uint8)[1:]  # misaligned
    dst = torch.zeros(sum(sizes) + 1, dtype=torch.uint8)[1:]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    batch = native.CopyBatch(
        [src.data_ptr() + o for o in starts],
        [dst.data_ptr() + o for o in starts],
        sizes,
        [b"", b"", b""],
        digest=False,
        streaming=streaming,
        streaming_min_bytes=1,
    )
    batch.run_with_helpers()
    assert torch.equal(src, dst)


def test_a_copy_batch_without_digests_only_copies() -> None:
    src = torch.randint(0, 256, (3 * 65536,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    batch = native.CopyBatch(
        [src.data_ptr(), src.data_ptr() + 65536], [dst.data_ptr(), None], [65536, 2 * 65536], [b"", b""], digest=False
    )
    batch.run()
    assert batch.digests() == []
    assert torch.equal(dst[:65536], src[:65536])
    assert not dst[65536:].any()  # the span without a destination was left alone


def test_an_unknown_native_copy_setting_is_refused_by_name() -> None:
    env = {**os.environ, "STRATA_NATIVE_COPY": "avx512"}
    done = subprocess.run(
        [sys.executable, "-c", "import worker.dataplane.native"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "STRATA_NATIVE_COPY: expected one of 1, 0, sse2, got 'avx512'" in done.stderr


def test_a_native_read_batch_reads_files_into_memory_and_hashes_each_span(tmp_path) -> None:
    data = torch.randint(0, 256, (5 * 65536,), dtype=torch.uint8)
    path = tmp_path / "spans.bin"
    path.write_bytes(data.numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        dsts = [torch.zeros(2 * 65536, dtype=torch.uint8), torch.zeros(65536, dtype=torch.uint8)]
        got, digests = native.ReadBatch(
            [fd, fd],
            [65536, 4 * 65536],
            [dst.data_ptr() for dst in dsts],
            [2 * 65536, 65536],
            65536,
            [b"a", b"bb", b"ccc"],
        ).read()
    finally:
        os.close(fd)
    assert got == [2 * 65536, 65536]
    assert torch.equal(dsts[0], data[65536 : 3 * 65536])
    assert torch.equal(dsts[1], data[4 * 65536 :])
    raw = data.numpy().tobytes()
    assert digests == [
        xxhash.xxh3_128(b"a" + raw[65536 : 2 * 65536]).digest(),
        xxhash.xxh3_128(b"bb" + raw[2 * 65536 : 3 * 65536]).digest(),
        xxhash.xxh3_128(b"ccc" + raw[4 * 65536 :]).digest(),
    ]


def test_a_native_read_batch_reports_short_reads_and_errors_per_read(tmp_path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 1000)
    fd = os.open(path, os.O_RDONLY)
    bad = os.open(path, os.O_RDONLY)
    os.close(bad)  # a closed descriptor: that read fails with EBADF, the others still run
    dst = torch.zeros(3 * 1024, dtype=torch.uint8)
    try:
        got, digests = native.ReadBatch(
            [fd, bad, fd],
            [0, 0, 0],
            [dst.data_ptr(), dst.data_ptr() + 1024, dst.data_ptr() + 2048],
            [1024, 1024, 512],
            512,
            [b"p"] * 5,
        ).read()
    finally:
        os.close(fd)
    assert got[0] == 1000  # the file ends first: short, so not hashed
    assert got[1] == -9  # -EBADF
    assert got[2] == 512
    assert digests[:4] == [b"", b"", b"", b""]
    assert digests[4] == xxhash.xxh3_128(b"p" + b"x" * 512).digest()


def test_a_native_read_batch_refuses_inconsistent_arguments() -> None:
    with pytest.raises(ValueError, match="one entry per read"):
        native.ReadBatch([1, 2], [0], [0, 0], [8, 8], 8, [b"", b""])
    with pytest.raises(ValueError, match="whole number of 8-byte hashed spans"):
        native.ReadBatch([1], [0], [0], [12], 8, [b""])
    with pytest.raises(ValueError, match="2 hashed spans but 1 prefixes"):
        native.ReadBatch([1], [0], [0], [16], 8, [b""])


def test_a_read_batch_run_by_two_threads_at_once_reads_each_piece_once(tmp_path) -> None:
    import threading  # noqa: PLC0415

    data = torch.randint(0, 256, (64 * 4096,), dtype=torch.uint8)
    path = tmp_path / "pieces.bin"
    path.write_bytes(data.numpy().tobytes())
    dst = torch.zeros_like(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        batch = native.ReadBatch(
            [fd] * 64,
            [i * 4096 for i in range(64)],
            [dst.data_ptr() + i * 4096 for i in range(64)],
            [4096] * 64,
            4096,
            [str(i).encode() for i in range(64)],
        )
        other = threading.Thread(target=batch.run)
        other.start()
        batch.run()
        other.join()
    finally:
        os.close(fd)
    got, digests = batch.results()
    assert got == [4096] * 64
    assert torch.equal(dst, data)
    raw = data.numpy().tobytes()
    assert digests == [xxhash.xxh3_128(str(i).encode() + raw[i * 4096 : (i + 1) * 4096]).digest() for i in range(64)]
