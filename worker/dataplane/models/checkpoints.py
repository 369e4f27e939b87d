"""Where a model's checkpoint lives and what it is: hub ids resolved offline, other directories
named by a digest of their content, computed once and kept.

A checkpoint's revision goes into its model key, so it must change whenever the KV the model
computes may change, and be the same on every node that holds the same files:

- A Hugging Face hub snapshot (`--model org/name`, found in the local hub cache, or a directory
  `models--org--name/snapshots/<commit>` given by path) is named by its commit hash; nothing is
  hashed. Its model id is `org--name`, the hub cache's own spelling (model ids hold no "/").
- Any other directory is `content-<digest>`: BLAKE2b of the bytes of the files that decide the KV
  for given token ids (`IDENTITY_FILES`, `IDENTITY_SUFFIXES`: config.json, the weights, shard
  indexes, custom modeling code). Tokenizer files and generation_config.json are left out:
  they change which token ids a text becomes, or how the next token is sampled, never the KV of
  the ids themselves (those ids are in every block key). Its model id is the directory's name.

The digest of a large checkpoint costs a full read, so it is kept, beside the checkpoint when
the directory is writable, else in the node's cache directory::

    <checkpoint>/.strata-revision.json            (or <cache_dir>/revisions/<H(path)>.json)
    {"format": 1, "path": "/abs/checkpoint", "stamped_ns": <clock when the files were stamped>,
     "files": [[name, size, mtime_ns, ctime_ns, inode], ...],     one per hashed file, by name
     "revision": "content-<32 hex>"}

A kept digest is used only for the same path and while every hashed file's stamp is the kept
one. Name, size and mtime alone are what two builds of a checkpoint may share (reproducible
builds set mtimes), and mtime can be set back; ctime cannot be set from user space, and a file
replaced by another has another inode, so a file written again or swapped differs. A filesystem
keeps ctime at a coarse granularity, so a file written again within the tick of its stamp could
keep it: a record whose files changed less than `RACY_NS` before they were stamped is not used
(as git treats a racily clean index entry), and the next start, files by then older, keeps one
that is. Anything else (a missing, unreadable or malformed cache file, one for another path)
means computing again. A cache file is written to a temporary name and renamed; one that cannot
be written is logged.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
from huggingface_hub.utils import validate_repo_id

from worker.dataplane.config import option_from_environ

log = logging.getLogger("strata.engine")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
"""Files of a checkpoint directory that hold weights (one file or shards)."""

IDENTITY_FILES = ("config.json",)
IDENTITY_SUFFIXES = (*WEIGHT_SUFFIXES, ".index.json", ".py")
"""What a content digest covers, besides `IDENTITY_FILES`: the weights, the index that says which
shard holds which tensor, and custom modeling code (a model loaded with trust_remote_code
computes with it)."""

REVISION_FILE = ".strata-revision.json"
"""The kept digest beside a checkpoint (its directory writable)."""

CACHE_FORMAT = 1
SEGMENT_BYTES = 64 << 20
"""Files are hashed in segments of this size, each on a thread of its own: a checkpoint of one
large file is read in parallel too. Part of the digest's definition: changing it renames every
local checkpoint."""
CHUNK_BYTES = 8 << 20
LARGE_BYTES = 1 << 30
"""Checkpoints from this size on say at INFO that they are being hashed, and how long it took."""
HASH_THREADS = 8
RACY_NS = 2_000_000_000
"""A kept digest of files changed less than this before they were stamped is not used (coarse
filesystem timestamps: see the module docstring)."""

_PERSON = b"strata-ckpt-v2"
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_REVISION = re.compile(r"^content-[0-9a-f]{32}$")


@dataclasses.dataclass(frozen=True, slots=True)
class Checkpoint:
    """A checkpoint directory and the names its blocks are keyed under."""

    path: Path
    """The directory holding config.json and the weights (absolute)."""
    model_id: str
    commit: str | None = None
    """The hub commit hash of a hub snapshot; None for any other directory."""


def hub_model_id(repo_id: str) -> str:
    """The model id of hub repository `org/name`: `org--name`, as the hub cache spells it."""
    return repo_id.replace("/", "--")


def is_repo_id(spec: str) -> bool:
    """Whether `spec` has the form of a hub repository id with its owner, `org/name`."""
    if spec.count("/") != 1:
        return False
    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return True


def hub_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The hub cache a hub id is looked up in, by huggingface_hub's precedence: HF_HUB_CACHE,
    HUGGINGFACE_HUB_CACHE, HF_HOME/hub, $XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub.
    Read at each call (huggingface_hub reads its variables once, at import)."""
    environ = os.environ if environ is None else environ
    explicit = environ.get("HF_HUB_CACHE") or environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = environ.get("HF_HOME") or os.path.join(environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def hub_checkpoint(
    repo_id: str, *, revision: str | None = None, environ: Mapping[str, str] | None = None
) -> Checkpoint:
    """The snapshot of hub repository `repo_id` (at `revision`: a branch, tag or commit; default
    main) in the local hub cache, never downloaded. ValueError, saying what to do, when absent."""
    cache = hub_cache_dir(environ)
    at = f" at revision {revision}" if revision else ""
    try:
        folder = Path(snapshot_download(repo_id=repo_id, revision=revision, cache_dir=cache, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError) as exc:
        raise ValueError(
            f"model: {repo_id}{at} is not in the Hugging Face hub cache {cache} (HF_HUB_CACHE, HF_HOME); nothing "
            f"is downloaded at start: download it beforehand (`hf download {repo_id}`) or give a local checkpoint "
            f"directory"
        ) from exc
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"model: the hub snapshot of {repo_id}{at} at {folder} has no config.json (an incomplete download? "
            f"`hf download {repo_id}` completes it)"
        )
    return Checkpoint(path=folder.resolve(), model_id=hub_model_id(repo_id), commit=folder.name)


def local_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint of local directory `path`. A hub snapshot's own directory
    (`models--org--name/snapshots/<commit>`) is the hub model `org/name` at that commit, so a node
    given the path and one given the hub id key their blocks alike."""
    path = Path(path).resolve()
    if not (path / "config.json").is_file():
        raise ValueError(f"model: {path} is not a checkpoint directory (a directory without config.json)")
    repo = path.parent.parent.name
    if path.parent.name == "snapshots" and repo.startswith("models--") and _COMMIT.match(path.name):
        return Checkpoint(path=path, model_id=repo.removeprefix("models--"), commit=path.name)
    return Checkpoint(path=path, model_id=path.name)


def node_cache_dir(configured: str | Path = "", environ: Mapping[str, str] | None = None) -> Path:
    """The node's cache directory: `configured`, else the cache_dir option (STRATA_CACHE_DIR), else
    $XDG_CACHE_HOME/strata, else ~/.cache/strata."""
    environ = os.environ if environ is None else environ
    configured = str(configured) or str(option_from_environ("cache_dir", environ))
    if configured:
        return Path(configured).expanduser()
    return Path(environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "strata"


def identity_files(path: Path) -> list[str]:
    """Names of the files of checkpoint `path` its content digest covers, sorted."""
    return sorted(
        entry.name
        for entry in os.scandir(path)
        if (entry.name in IDENTITY_FILES or entry.name.endswith(IDENTITY_SUFFIXES)) and entry.is_file()
    )


def _stamps(path: Path, names: list[str]) -> list[list[Any]]:
    stamps: list[list[Any]] = []
    for name in names:
        stat = (path / name).stat()
        stamps.append([name, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino])
    return stamps


def _kept_file(path: Path, cache_dir: Path) -> Path:
    """Where the digest of a checkpoint whose directory is read-only is kept."""
    return cache_dir / "revisions" / f"{hashlib.blake2b(str(path).encode(), digest_size=16).hexdigest()}.json"


def _read_kept(file: Path, path: Path, stamps: list[list[Any]]) -> str | None:
    """The revision kept in `file` when it is for `path` and `stamps`; None otherwise."""
    try:
        record = json.loads(file.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        log.info("model %s: the kept digest %s cannot be used (%s); computing it again", path.name, file, exc)
        return None
    if not isinstance(record, dict) or record.get("format") != CACHE_FORMAT or record.get("path") != str(path):
        return None
    revision, stamped_ns = record.get("revision"), record.get("stamped_ns")
    if record.get("files") != stamps or not isinstance(revision, str) or not _REVISION.match(revision):
        return None
    if not isinstance(stamped_ns, int) or any(stamp[3] > stamped_ns - RACY_NS for stamp in stamps):
        return None  # a file written again within its stamp's tick could have kept the stamp
    return revision


def _keep(file: Path, record: dict[str, Any]) -> bool:
    """Write `record` to `file` through a temporary file and a rename; False when it cannot be."""
    temporary = file.with_name(f".{file.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(json.dumps(record))
        os.replace(temporary, file)
    except OSError as exc:
        log.debug("cannot write %s: %s", file, exc)
        try:
            temporary.unlink(missing_ok=True)
        except OSError:
            pass
        return False
    return True


def _hash_segment(file: Path, offset: int, length: int) -> bytes:
    digest = hashlib.blake2b(person=_PERSON)
    buffer = memoryview(bytearray(max(1, min(CHUNK_BYTES, length))))
    with open(file, "rb", buffering=0) as source:
        source.seek(offset)
        remaining = length
        while remaining:
            read = source.readinto(buffer[: min(remaining, len(buffer))])
            if not read:
                raise ValueError(f"model: {file} changed while its content digest was computed; start again")
            digest.update(buffer[:read])  # hashlib releases the GIL on updates this large
            remaining -= read
    return digest.digest()


def content_digest(path: Path, stamps: list[list[Any]]) -> str:
    """`content-<hex>` of the files `stamps` name: each file's segments hashed on parallel
    threads, each file's digest over its segments', the checkpoint's over the names, sizes and
    digests of its files."""
    segments = [
        (name, offset, min(SEGMENT_BYTES, size - offset))
        for name, size, *_ in stamps
        for offset in (range(0, size, SEGMENT_BYTES) if size else [0])
    ]
    workers = max(1, min(HASH_THREADS, os.cpu_count() or 1, len(segments)))
    try:
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="strata-digest") as pool:
            digests = list(pool.map(lambda s: _hash_segment(path / s[0], s[1], s[2]), segments))
    except OSError as exc:
        raise ValueError(f"model: cannot read {exc.filename or path} to compute its content digest: {exc}") from exc
    per_file: dict[str, list[bytes]] = {}
    for (name, _, _), digest in zip(segments, digests, strict=True):
        per_file.setdefault(name, []).append(digest)
    whole = hashlib.blake2b(digest_size=16, person=_PERSON)
    for name, size, *_ in stamps:
        file_digest = hashlib.blake2b(b"".join(per_file[name]), person=_PERSON).digest()
        whole.update(f"\0{name}\0{size}\0".encode() + file_digest)
    return f"content-{whole.hexdigest()}"


def checkpoint_revision(path: str | Path, *, cache_dir: str | Path = "") -> str:
    """The revision of a local checkpoint without a hub commit hash: `content-<hex>`, a BLAKE2b
    digest of the bytes of its config.json, weight files (`WEIGHT_SUFFIXES`), shard index files
    and custom modeling code (*.py). Tokenizer files and generation_config.json are not in it:
    they never change the KV of given token ids. Two checkpoints with the same files get the same
    revision wherever they lie (nodes agree across machines); any other weights get another, so
    their blocks never meet. Computed once and kept (see the module docstring): beside the
    checkpoint, or under `cache_dir` (default: `node_cache_dir()`) where the directory is
    read-only; a file written or replaced since means computing it again."""
    path = Path(path).resolve()
    if not (path / "config.json").is_file():
        raise ValueError(f"model: {path} is not a checkpoint directory (a directory without config.json)")
    names = identity_files(path)
    stamped_ns = time.time_ns()
    try:
        stamps = _stamps(path, names)
    except OSError as exc:
        raise ValueError(f"model: cannot read {exc.filename} to compute its content digest: {exc.strerror}") from exc
    beside = path / REVISION_FILE
    elsewhere = _kept_file(path, node_cache_dir(cache_dir))
    for file in (beside, elsewhere):
        if (revision := _read_kept(file, path, stamps)) is not None:
            return revision
    target = beside if os.access(path, os.W_OK) else elsewhere
    total = sum(stamp[1] for stamp in stamps)
    level = logging.INFO if total >= LARGE_BYTES else logging.DEBUG
    log.log(level, "model %s: computing its content digest (%.1f GB, once; kept in %s)", path.name, total / 1e9, target)
    started = time.perf_counter()
    revision = content_digest(path, stamps)
    elapsed = time.perf_counter() - started
    if _stamps(path, names) != stamps:
        raise ValueError(f"model: the files of {path} changed while their content digest was computed; start again")
    log.log(
        level,
        "model %s: content digest %s in %.1f s (%.2f GB/s)",
        path.name,
        revision,
        elapsed,
        total / 1e9 / max(elapsed, 1e-9),
    )
    record = {
        "format": CACHE_FORMAT,
        "path": str(path),
        "stamped_ns": stamped_ns,
        "files": stamps,
        "revision": revision,
    }
    if not any(_keep(file, record) for file in dict.fromkeys((target, elsewhere))):
        log.warning(
            "model %s: its content digest could not be kept (in %s or %s); it is computed again at the next start",
            path.name,
            beside,
            elsewhere,
        )
    return revision
