"""The fused copy-and-hash routine (copyhash.c), built into the package when it is installed, and
the copies between vLLM's CPU attention pages and Strata's blocks (kvpages.c, `kv_pages`).

The hasher calls it for every verified copy: one call per batch of spans, with the
interpreter lock released for its whole length, shared with the library's own helper threads
(`start_helpers`), which stay awake a moment between batches. Where it was not built (no C compiler or no
xxhash header when the package was installed), the hasher falls back to hashing in Python,
chunk by chunk, which is correct but slower and gives up the interpreter lock at every chunk;
the option `native_copy` set to 0 forces that fallback, and set to sse2 the baseline build on a
CPU that has AVX2.

The library is loaded on import with the choice of the STRATA_NATIVE_COPY variable alone (a
process that never loads a node configuration: tests, tools, benchmarks); the node runtime then
applies its configuration's `native_copy` (flag > variable > YAML) with `use` before it builds
its store."""

from __future__ import annotations

import array
import ctypes
import importlib.machinery
import itertools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from worker.dataplane.config import option_from_environ
from worker.dataplane.config_values import NATIVE_COPY_CHOICES

log = logging.getLogger(__name__)

DIGEST = 1
NONTEMPORAL = 2
STREAMING_MIN_BYTES = 256 * 1024
"""Spans at least this long are written with streaming (cache-bypassing) stores: they would
push everything else out of the cache anyway, and skipping the read-for-ownership of the
destination saves a third of the memory traffic. Shorter spans stay in cache for their reader."""

_u64p = ctypes.POINTER(ctypes.c_uint64)


def _cpu_has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            return any(line.startswith("flags") and " avx2" in line for line in cpuinfo)
    except OSError:
        return False


def _library_path(choice: str) -> Path | None:
    """The AVX2 build where the CPU has AVX2 (its hash runs on wider vectors), else the SSE2 one."""
    here = Path(__file__).resolve().parent
    wide = _cpu_has_avx2() and choice != "sse2"
    names = ["_copyhash_avx2", "_copyhash"] if wide else ["_copyhash"]
    for name in names:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = here / f"{name}{suffix}"
            if path.exists():
                return path
    return None


CHOICES = NATIVE_COPY_CHOICES
"""Values of STRATA_NATIVE_COPY: the best build for the CPU (the default), none, the SSE2 one."""


def _environ_choice() -> str:
    """The `native_copy` option from STRATA_NATIVE_COPY alone (ConfigError naming it when invalid)."""
    return str(option_from_environ("native_copy"))


class PoolGeometry(ctypes.Structure):
    """Where a host pool keeps what a verified read needs (see `pool_read`): the address of slot
    0's metadata record and the record size, each field's offset in a record, the address of slot
    0's bytes and the slot size, the block layout, and the state value of a readable slot."""

    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "meta",
            "stride",
            "gen",
            "state",
            "key",
            "nbytes",
            "checksum",
            "layer_sums",
            "data",
            "slot_bytes",
            "layers",
            "layer_bytes",
            "block_bytes",
            "ready",
        )
    ]


class KvGeometry(ctypes.Structure):
    """One engine's CPU KV pages and the blocks they are copied from or to (see `kv_pages`): bytes
    per element, kv heads, head_dim, tokens per page, the bytes from a page to the next and from
    a head's K (or V) to the next head's, and on the block side the tokens per block, the bytes
    from a block to the next and from a token to the next."""

    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "elem",
            "heads",
            "dim",
            "page_tokens",
            "page_stride",
            "head_stride",
            "block_tokens",
            "block_stride",
            "token_stride",
        )
    ]


KV_LAYOUTS = {"cpu-vec": 0, "cpu-amx": 1}
"""The page layouts `kv_pages` copies (pages.py describes them), by their number in kvpages.c."""


READ_OK, READ_UNSETTLED, READ_TORN, READ_SIZE, READ_BLOCK_SUM = 0, -1, -2, -3, -4
"""`pool_read` statuses; a positive status is 1 + the layer whose checksum did not match."""
_WITH_HELPERS = 4


def _load(choice: str) -> ctypes.CDLL | None:
    if choice == "0":
        log.info("fused copy-and-hash disabled by native_copy=0; hashing in Python")
        return None
    path = _library_path(choice)
    if path is None:
        log.warning(
            "fused copy-and-hash is not built (worker/dataplane/native/copyhash.c needs a C "
            "compiler and xxhash.h at install time); verified copies run slower, in Python"
        )
        return None
    library = ctypes.CDLL(str(path))
    function = library.strata_copy_hash
    function.argtypes = [
        ctypes.c_size_t,
        ctypes.c_void_p,  # the span arrays: addresses of CopyBatch's array.array buffers
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_char_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_size_t,
        ctypes.c_char_p,
        _u64p,
    ]
    function.restype = ctypes.c_int
    reader = library.strata_read_hash
    reader.argtypes = [
        ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_int32),
        _u64p,
        _u64p,
        _u64p,
        ctypes.c_size_t,
        ctypes.c_char_p,
        _u64p,
        _u64p,
        ctypes.c_char_p,
        ctypes.POINTER(ctypes.c_int64),
        _u64p,
    ]
    reader.restype = ctypes.c_int
    pooled = library.strata_copy_hash_pooled
    pooled.argtypes = function.argtypes
    pooled.restype = ctypes.c_int
    starter = library.strata_pool_start
    starter.argtypes = [ctypes.c_int, ctypes.c_uint64]
    starter.restype = ctypes.c_int
    library.strata_pool_helper_spans.argtypes = []
    library.strata_pool_helper_spans.restype = ctypes.c_uint64
    pool_reader = library.strata_pool_read
    pool_reader.argtypes = [
        ctypes.POINTER(PoolGeometry),
        ctypes.c_size_t,
        ctypes.c_void_p,  # slots (u32), an array.array's buffer
        ctypes.c_char_p,  # keys, 16 bytes each
        ctypes.c_void_p,  # destinations (u64)
        ctypes.c_uint32,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_size_t,
        ctypes.c_char_p,  # layer checksums out
        ctypes.c_char_p,  # block checksums out
        ctypes.c_void_p,  # generations out (u64)
        ctypes.c_void_p,  # statuses out (i32)
    ]
    pool_reader.restype = ctypes.c_int
    pool_filler = library.strata_pool_fill
    pool_filler.argtypes = [
        ctypes.POINTER(PoolGeometry),
        ctypes.c_size_t,
        ctypes.c_void_p,  # slots (u32)
        ctypes.c_char_p,  # keys, 16 bytes each
        ctypes.c_void_p,  # sources (u64)
        ctypes.c_int,
        ctypes.c_size_t,
        ctypes.c_char_p,  # layer checksums out
        ctypes.c_char_p,  # block checksums out
    ]
    pool_filler.restype = ctypes.c_int
    kv_pages = library.strata_kv_pages
    kv_pages.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.POINTER(KvGeometry),
        ctypes.c_uint64,
        ctypes.c_uint64,
        ctypes.c_uint64,
        ctypes.c_uint64,
    ]
    kv_pages.restype = ctypes.c_int
    return library


_choice = _environ_choice()
_library = _load(_choice)


def use(choice: str) -> None:
    """Load the build `choice` names (a validated `native_copy` value) in place of the one chosen
    on import. Called by the node runtime before anything copies, hashes or starts helpers."""
    global _choice, _library
    if choice not in CHOICES:
        raise ValueError(f"native_copy: expected one of {', '.join(CHOICES)}, got {choice!r}")
    if choice != _choice:
        _choice, _library = choice, _load(choice)


def available() -> bool:
    return _library is not None


def build() -> str:
    """Which build is in use: 'avx2', 'sse2', or 'python' (the fallback)."""
    if _library is None:
        return "python"
    return "avx2" if "_copyhash_avx2" in str(_library._name) else "sse2"


HELPER_SPIN_US = 50
"""How long a helper thread keeps watching for the next job before it sleeps: long enough to
span the interpreter's work between two block copies, short enough that an idle process
gives its cores back at once."""


def start_helpers(count: int, spin_us: int = HELPER_SPIN_US) -> int:
    """Start native helper threads until `count` run in this process (see
    `CopyBatch.run_with_helpers`); returns how many run."""
    if _library is None:
        return 0
    return int(_library.strata_pool_start(count, spin_us))


def helper_spans() -> int:
    """How many spans the native helper threads of this process have copied or hashed in all."""
    return 0 if _library is None else int(_library.strata_pool_helper_spans())


class CopyBatch:
    """Copies and hashes of memory spans in one native call without the interpreter lock: span i
    is `sizes[i]` bytes at `sources[i]`, copied to `destinations[i]` where one is set, hashed after
    `prefixes[i]` when `digest`. Prepared once, run by one thread or by several at once (`run` in
    each, then `digests`): `run` claims spans one at a time until none is left, so the threads
    share the spans out as they go and finish together, however late one of them starts."""

    def __init__(
        self,
        sources: Sequence[int],
        destinations: Sequence[int | None],
        sizes: Sequence[int],
        prefixes: Sequence[bytes],
        *,
        digest: bool,
        streaming: bool = True,
        streaming_min_bytes: int = STREAMING_MIN_BYTES,
    ) -> None:
        if _library is None:
            raise RuntimeError("the fused copy-and-hash library is not built")
        count = len(sources)
        if not (len(destinations) == len(sizes) == len(prefixes) == count):
            raise ValueError("sources, destinations, sizes and prefixes must have one entry per span")
        # array.array builds in a tenth of the time of a ctypes array; the call takes addresses.
        self._arrays = (
            array.array("Q", sources),
            array.array("Q", [d or 0 for d in destinations]),
            array.array("Q", sizes),
            array.array("Q", itertools.accumulate(map(len, prefixes), initial=0)),
        )
        self._count = count
        self._digest = digest
        self._out = ctypes.create_string_buffer(16 * count if digest else 1)
        self._args = (
            count,
            *(a.buffer_info()[0] for a in self._arrays[:3]),
            b"".join(prefixes),
            self._arrays[3].buffer_info()[0],
            (DIGEST if digest else 0) | (NONTEMPORAL if streaming else 0),
            streaming_min_bytes,
            self._out,
        )
        self._next = ctypes.c_uint64(0)

    def run(self, *, shared: bool = True) -> None:
        """Work through the spans not yet claimed (with `shared` False: all of them, in order, on
        this thread alone)."""
        function = _library.strata_copy_hash  # type: ignore[union-attr]
        self._call(function, ctypes.byref(self._next) if shared else None)

    def run_with_helpers(self) -> None:
        """Work through the spans on this thread and the native helper threads (`start_helpers`)
        together, returning when all of them are done; on this thread alone when there are no
        helpers or another thread's batch has them."""
        function = _library.strata_copy_hash_pooled  # type: ignore[union-attr]
        self._call(function, ctypes.byref(self._next))

    def _call(self, function: Any, next_span: Any) -> None:
        status = function(*self._args, next_span)
        if status != 0:
            raise RuntimeError(f"fused copy-and-hash failed with status {status}")

    def digests(self) -> list[bytes]:
        """One 16-byte digest per span (an empty list when the batch does not hash)."""
        if not self._digest:
            return []
        raw = self._out.raw
        return [raw[16 * i : 16 * i + 16] for i in range(self._count)]


def pool_read(
    geometry: PoolGeometry,
    slots: Sequence[int],
    keys: bytes,
    destinations: Sequence[int],
    first_layer: int,
    layers: int,
    *,
    streaming: bool,
    helpers: bool,
) -> tuple[list[int], list[int], bytes, bytes]:
    """Verified reads of layers [first_layer, first_layer + layers) of blocks out of a host pool
    in one call without the interpreter lock: block i from slot `slots[i]`, its key the 16 bytes
    at 16 i of `keys`, into `destinations[i]` (the layers back to back). The slot is checked
    stable, READY and holding the key before the copy and unchanged after it; the copies are
    hashed and compared with the stored checksums (and, for whole blocks, the block checksum with
    its layers'). Returns per block a status (READ_*), the generation seen, and the stored layer
    checksums (16 bytes x layers per block) and block checksums (16 bytes each) as read before
    the copy. `streaming`: write past the cache; `helpers`: share the copies with the helper
    threads (`start_helpers`)."""
    count, slot_array, dst_array, flags = _pool_arguments(slots, keys, destinations, streaming, helpers)
    sums = ctypes.create_string_buffer(16 * layers * count or 1)
    block_sums = ctypes.create_string_buffer(16 * count or 1)
    gens = array.array("Q", bytes(8 * count))
    statuses = array.array("i", bytes(4 * count))
    status = _library.strata_pool_read(  # type: ignore[union-attr]
        ctypes.byref(geometry),
        count,
        slot_array.buffer_info()[0],
        keys,
        dst_array.buffer_info()[0],
        first_layer,
        layers,
        flags,
        STREAMING_MIN_BYTES,
        sums,
        block_sums,
        gens.buffer_info()[0],
        statuses.buffer_info()[0],
    )
    if status != 0:
        raise RuntimeError(f"verified pool read failed with status {status}")
    return statuses.tolist(), gens.tolist(), sums.raw, block_sums.raw


def _pool_arguments(
    slots: Sequence[int], keys: bytes, addresses: Sequence[int], streaming: bool, helpers: bool
) -> tuple[int, array.array[int], array.array[int], int]:
    """What pool_read and pool_fill pass: the count, the slots (u32) and the addresses (u64) as
    arrays, and the flags; one 16-byte key and one address per slot, or ValueError."""
    if _library is None:
        raise RuntimeError("the fused copy-and-hash library is not built")
    count = len(slots)
    if len(keys) != 16 * count or len(addresses) != count:
        raise ValueError(
            f"{count} slots need {count} 16-byte keys and {count} addresses, "
            f"got {len(keys)} key bytes and {len(addresses)} addresses"
        )
    flags = (NONTEMPORAL if streaming else 0) | (_WITH_HELPERS if helpers else 0)
    return count, array.array("I", slots), array.array("Q", addresses), flags


def pool_fill(
    geometry: PoolGeometry,
    slots: Sequence[int],
    keys: bytes,
    sources: Sequence[int],
    *,
    streaming: bool,
    helpers: bool,
) -> tuple[bytes, bytes]:
    """Writes of whole blocks into host pool slots the caller has allocated and still holds, in
    one call without the interpreter lock: block i from the memory at `sources[i]` into slot
    `slots[i]`, its key the 16 bytes at 16 i of `keys`, every layer hashed as it is copied; the
    slot's metadata gets the layer checksums, the block checksum and the size. Returns the layer
    checksums (16 bytes x layers per block) and the block checksums (16 bytes each). `streaming`
    and `helpers` as in `pool_read`."""
    count, slot_array, src_array, flags = _pool_arguments(slots, keys, sources, streaming, helpers)
    sums = ctypes.create_string_buffer(16 * geometry.layers * count or 1)
    block_sums = ctypes.create_string_buffer(16 * count or 1)
    status = _library.strata_pool_fill(  # type: ignore[union-attr]
        ctypes.byref(geometry),
        count,
        slot_array.buffer_info()[0],
        keys,
        src_array.buffer_info()[0],
        flags,
        STREAMING_MIN_BYTES,
        sums,
        block_sums,
    )
    if status != 0:
        raise RuntimeError(f"verified pool write failed with status {status}")
    return sums.raw, block_sums.raw


class ReadBatch:
    """Reads of file ranges into memory, each hashed as it lands, in one native call without the
    interpreter lock: read i is `sizes[i]` bytes of `fds[i]` at `offsets[i]` into the memory at
    `destinations[i]`, hashed whole as consecutive `hash_bytes` spans, each with the next of
    `prefixes`. Prepared once, run by one thread (`read`) or by several at once (`run` in each,
    then `results`): `run` claims reads one at a time until none is left, so threads that call
    it together share the reads out as they go and finish together."""

    def __init__(
        self,
        fds: Sequence[int],
        offsets: Sequence[int],
        destinations: Sequence[int],
        sizes: Sequence[int],
        hash_bytes: int,
        prefixes: Sequence[bytes],
    ) -> None:
        if _library is None:
            raise RuntimeError("the fused copy-and-hash library is not built")
        count = len(fds)
        if not (len(offsets) == len(destinations) == len(sizes) == count):
            raise ValueError("fds, offsets, destinations and sizes must have one entry per read")
        if hash_bytes <= 0 or any(size % hash_bytes for size in sizes):
            raise ValueError(f"every read must be a whole number of {hash_bytes}-byte hashed spans")
        first_span = [0]
        for size in sizes:
            first_span.append(first_span[-1] + size // hash_bytes)
        spans = first_span[-1]
        if len(prefixes) != spans:
            raise ValueError(f"{spans} hashed spans but {len(prefixes)} prefixes")
        prefix_offsets = [0]
        for prefix in prefixes:
            prefix_offsets.append(prefix_offsets[-1] + len(prefix))
        array = ctypes.c_uint64 * count
        self._sizes = list(sizes)
        self._hash_bytes = hash_bytes
        self._args = (
            count,
            (ctypes.c_int32 * count)(*fds),
            array(*offsets),
            array(*destinations),
            array(*sizes),
            hash_bytes,
            b"".join(prefixes),
            (ctypes.c_uint64 * (spans + 1))(*prefix_offsets),
            (ctypes.c_uint64 * (count + 1))(*first_span),
        )
        self._digests = ctypes.create_string_buffer(16 * max(1, spans))
        self._got = (ctypes.c_int64 * count)()
        self._next = ctypes.c_uint64(0)

    def run(self) -> None:
        status = _library.strata_read_hash(  # type: ignore[union-attr]
            *self._args, self._digests, self._got, ctypes.byref(self._next)
        )
        if status != 0:
            raise RuntimeError(f"fused read-and-hash failed with status {status}")

    def read(self) -> tuple[list[int], list[bytes]]:
        """`run` on this thread alone, then `results`."""
        self.run()
        return self.results()

    def results(self) -> tuple[list[int], list[bytes]]:
        """Per read the bytes read (fewer at the end of a file) or -errno; per hashed span its
        16-byte digest (empty for the spans of a read that was not read whole)."""
        raw = self._digests.raw
        got = list(self._got)
        digests: list[bytes] = []
        for i, size in enumerate(self._sizes):
            whole = got[i] == size
            for _ in range(size // self._hash_bytes):
                k = len(digests)
                digests.append(raw[16 * k : 16 * k + 16] if whole else b"")
        return got, digests


def kv_pages(
    layout: str, part: str, *, to_pages: bool, geometry: KvGeometry, pages: int, tokens: int, skip: int, count: int
) -> bool:
    """Copy `count` tokens of K or V (`part`) between consecutive pages of one layer (`pages`: the
    first page's address, at the part's offset) and tokens [skip, skip + count) of the block side
    (`tokens`: the address of a block's first token), to the pages with `to_pages`, else from them;
    without the interpreter lock. False where the library is not built (the caller copies with
    torch); ValueError for a geometry the layout cannot have."""
    if _library is None:
        return False
    status = _library.strata_kv_pages(
        KV_LAYOUTS[layout], 0 if part == "k" else 1, int(to_pages), ctypes.byref(geometry), pages, tokens, skip, count
    )
    if status != 0:
        raise ValueError(
            f"{layout} pages: no such geometry ({geometry.elem}-byte elements, {geometry.page_tokens} "
            f"tokens a page, head_dim {geometry.dim})"
        )
    return True
