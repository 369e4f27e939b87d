"""What of a vLLM request decides its KV, and so its blocks' keys: the LoRA adapter it runs on (its
name and a digest of its weights) and its cache salt (`KeyScope`), beside its tokens. vLLM's own
prefix cache keys its pages on the same things (its block hash carries the adapter, the salt,
multimodal inputs and prompt embeddings), so two requests share a Strata block only where vLLM
alone would have shared a page.

A request Strata cannot key is served uncached and counted, never served from a key that ignores
what it carries: prompt embeddings, multimodal inputs, an adapter whose files cannot be read,
and any field of vLLM's `Request` this module does not know (a newer vLLM may add one that
changes the KV) set to something other than its empty value.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from worker.dataplane.hashing import KeyScope

log = logging.getLogger("strata.vllm")

KEYED_FIELDS = frozenset({"prompt_token_ids", "lora_request", "cache_salt"})
"""Fields of vLLM's Request that go into the keys: the tokens, the adapter, the salt."""

UNKEYED_FIELDS = frozenset({"prompt_embeds", "prompt_is_token_ids", "mm_features"})
"""Fields that change the KV in ways Strata does not key: a request that sets one is uncached."""

NEUTRAL_FIELDS = frozenset(
    {
        "request_id",
        "sampling_params",  # how the next token is chosen, not the KV of the tokens
        "pooling_params",
        "client_index",
        "arrival_time",
        "priority",
        "trace_headers",
        "block_hasher",
        "resumable",  # streamed input: more tokens, keyed as they come
        "session_id",
        "reasoning_ended",
        "reasoning_parser_kwargs",
        "abort_immediately",
        "kv_hints",
        "block_hashes",  # vLLM's own page hashes (0.34): derived from the keyed fields
    }
)
"""Fields of vLLM's Request that do not change the KV of its tokens."""

KNOWN_FIELDS = KEYED_FIELDS | UNKEYED_FIELDS | NEUTRAL_FIELDS

ADAPTER_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
ADAPTER_FILES = ("adapter_config.json",)
"""What of an adapter directory is hashed: its config and its weight files."""


def request_fields(request_class: type) -> list[str]:
    """The fields vLLM's Request takes (the parameters of its constructor)."""
    return [name for name in inspect.signature(request_class).parameters if name != "self"]


def unknown_fields(request_class: type) -> list[str]:
    """Fields of vLLM's Request this module does not know: a request that sets one is uncached."""
    return sorted(set(request_fields(request_class)) - KNOWN_FIELDS)


def _is_empty(value: Any) -> bool:
    return value is None or value is False or (not isinstance(value, bool) and value in (0, "", (), [], {}))


def uncached_reason(request: Any, unknown: frozenset[str] | set[str] = frozenset()) -> str:
    """Why a request cannot be keyed ("" when it can): prompt_embeds, multimodal, or the name of
    an unknown field it sets."""
    if getattr(request, "prompt_token_ids", None) is None or getattr(request, "prompt_embeds", None) is not None:
        return "prompt_embeds"
    if getattr(request, "mm_features", None):
        return "multimodal"
    marks = getattr(request, "prompt_is_token_ids", None)
    if marks is not None and not all(marks):
        return "prompt_embeds"
    for name in sorted(unknown):
        if not _is_empty(getattr(request, name, None)):
            return f"field.{name}"
    return ""


@dataclasses.dataclass(frozen=True)
class _Stamp:
    """What a file's metadata says of it; any change (a rewrite changes ctime) means hash again."""

    name: str
    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int


class AdapterUnreadable(ValueError):
    """A LoRA adapter whose files Strata cannot read to digest: its requests are uncached."""


class AdapterDigests:
    """The digest of each LoRA adapter's files (config and weights), computed once per version of
    the files and kept in memory: a file whose size, times or inode changed is hashed again."""

    def __init__(self, resolve: Callable[[str], Path] | None = None) -> None:
        self._resolve = resolve or _adapter_directory
        self._lock = threading.Lock()
        self._known: dict[str, tuple[tuple[_Stamp, ...], str]] = {}

    def _files(self, directory: Path) -> list[Path]:
        try:
            entries = sorted(directory.iterdir())
        except OSError as exc:
            raise AdapterUnreadable(f"LoRA adapter {directory}: cannot list its files ({exc})") from exc
        files = [p for p in entries if p.is_file() and (p.name in ADAPTER_FILES or p.suffix in ADAPTER_WEIGHT_SUFFIXES)]
        if not any(p.suffix in ADAPTER_WEIGHT_SUFFIXES for p in files):
            raise AdapterUnreadable(f"LoRA adapter {directory}: no weight file ({', '.join(ADAPTER_WEIGHT_SUFFIXES)})")
        return files

    @staticmethod
    def _stamps(files: list[Path]) -> tuple[_Stamp, ...]:
        stamps = []
        for path in files:
            stat = path.stat()
            stamps.append(_Stamp(path.name, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino))
        return tuple(stamps)

    def known(self, path: str) -> str | None:
        """The adapter's digest if its files have not changed since it was computed, else None."""
        try:
            directory = self._resolve(path)
            stamps = self._stamps(self._files(directory))
        except (OSError, ValueError):
            return None
        with self._lock:
            found = self._known.get(str(directory))
        return found[1] if found is not None and found[0] == stamps else None

    def digest(self, path: str) -> str:
        """The digest of the adapter's config and weights (BLAKE2b, hex): computed now if its
        files changed since the last time. AdapterUnreadable when they cannot be read."""
        directory = self._resolve(path)
        files = self._files(directory)
        try:
            stamps = self._stamps(files)
            with self._lock:
                found = self._known.get(str(directory))
            if found is not None and found[0] == stamps:
                return found[1]
            digest = hashlib.blake2b(digest_size=16, person=b"strata-lora")
            for file in files:
                digest.update(f"\0{file.name}\0".encode())
                with open(file, "rb") as handle:
                    while chunk := handle.read(8 << 20):
                        digest.update(chunk)
            if self._stamps(files) != stamps:  # written while it was read: not a version to keep
                raise AdapterUnreadable(f"LoRA adapter {directory}: its files changed while they were read")
        except OSError as exc:
            raise AdapterUnreadable(f"LoRA adapter {directory}: cannot read its files ({exc})") from exc
        value = digest.hexdigest()
        with self._lock:
            self._known[str(directory)] = (stamps, value)
        log.info("LoRA adapter %s: content digest %s", directory, value)
        return value


def _adapter_directory(path: str) -> Path:
    """The local directory of an adapter named by path or, offline, by hub id."""
    local = Path(os.path.expanduser(path))
    if local.is_dir():
        return local.resolve()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=path, local_files_only=True))
    except Exception as exc:  # noqa: BLE001 - not a directory, not in the hub cache: unkeyable
        raise AdapterUnreadable(f"LoRA adapter {path!r}: neither a local directory nor in the local hub cache") from exc


def adapter_of(request: Any) -> tuple[str, str] | None:
    """(name, path) of the request's LoRA adapter, None for the base model."""
    lora = getattr(request, "lora_request", None)
    if not lora:
        return None
    return str(lora.lora_name), str(lora.lora_path)


def scope_of(request: Any, adapters: AdapterDigests, *, wait: bool) -> KeyScope | None:
    """The request's key scope: its adapter (name and weight digest) and cache salt. None when
    the adapter's digest is not known yet and `wait` is false (compute it where waiting is
    fine). AdapterUnreadable when the adapter cannot be digested."""
    adapter = ""
    named = adapter_of(request)
    if named is not None:
        name, path = named
        digest = adapters.digest(path) if wait else adapters.known(path)
        if digest is None:
            return None
        adapter = f"{name}@{digest}"
    return KeyScope(adapter=adapter, salt=str(getattr(request, "cache_salt", None) or ""))
