"""Block fingerprints: 128-bit keyed BLAKE2b prefix and content keys, stable across processes.

A key hashes the namespace's salt (the BLAKE2b key), the model key, the tokens and, for a prefix
key, its parent's key. What else decides a request's KV besides its tokens and its model - the
LoRA adapter it runs on, the cache salt a tenant keeps secret - is its `KeyScope`: the scope's
root takes the place of the zero parent of the chain's first block (so every prefix key after
it differs too), and is hashed into every content key. A request without a scope keys its
blocks as before scopes existed."""

from __future__ import annotations

import dataclasses
import hashlib
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from worker.dataplane.profile import KEY_BYTES, ModelProfile, model_key

ROOT_PARENT = uuid.UUID(int=0)
"""The parent of a prompt's first block (no block precedes it)."""

# BLAKE2b personalisation strings (16 bytes at most) keep the three kinds of keys apart even
# when their inputs happen to be equal byte strings (the model key's is `profile.PERSON_MODEL`).
_PERSON_PREFIX = b"strata/prefix/v1"
_PERSON_CONTENT = b"strata/content/1"
_PERSON_CONTENT_SCOPED = b"strata/content/s"
_PERSON_SCOPE = b"strata/scope/v1"


def _salt(ns_salt: bytes | str) -> bytes:
    salt = ns_salt.encode() if isinstance(ns_salt, str) else bytes(ns_salt)
    if len(salt) > hashlib.blake2b.MAX_KEY_SIZE:
        raise ValueError(f"ns_salt is at most {hashlib.blake2b.MAX_KEY_SIZE} bytes, got {len(salt)}")
    return salt


def _uuid_bytes(value: uuid.UUID | bytes) -> bytes:
    raw = value.bytes if isinstance(value, uuid.UUID) else bytes(value)
    if len(raw) != KEY_BYTES:
        raise ValueError(f"a key is {KEY_BYTES} bytes, got {len(raw)}")
    return raw


def encode_tokens(token_ids: Sequence[int] | np.ndarray | Any) -> bytes:
    """Token ids as little-endian uint32 bytes: the same ids give the same bytes on every
    platform, whatever container (list, numpy, torch) they came in."""
    array = np.asarray(token_ids)
    if array.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {array.shape}")
    if array.size == 0:
        return b""
    if not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"token ids must be integers, got {array.dtype}")
    if int(array.min()) < 0 or int(array.max()) >= 2**32:
        raise ValueError("token ids must lie in 0..2**32-1")
    return array.astype("<u4", copy=False).tobytes()


def _prefix_key_raw(salt: bytes, model: bytes, parent: bytes, tokens: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES, key=salt, person=_PERSON_PREFIX)
    h.update(model)
    h.update(parent)
    h.update(tokens)
    return h.digest()


def _content_key_raw(salt: bytes, model: bytes, tokens: bytes, scope: bytes = b"") -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES, key=salt, person=_PERSON_CONTENT_SCOPED if scope else _PERSON_CONTENT)
    h.update(model)
    h.update(scope)
    h.update(tokens)
    return h.digest()


@dataclasses.dataclass(frozen=True)
class KeyScope:
    """What decides a request's KV besides its tokens, its model and its namespace: two requests
    share blocks only when their scopes are equal (vLLM shares prefix-cache pages on the same
    terms: its block hash carries the LoRA adapter and the cache salt).

    `adapter` names the LoRA adapter and the digest of its weights ("" for the base model);
    `salt` is the request's cache salt, a tenant's secret: it is hashed, never stored, so keys
    in the directory say nothing of it, and a request without it never finds its blocks."""

    adapter: str = ""
    salt: str = ""

    def __bool__(self) -> bool:
        return bool(self.adapter or self.salt)

    def root(self, *, ns_salt: bytes | str, model_key: uuid.UUID) -> uuid.UUID | None:
        """The parent of the chain's first block (None: no scope, the zero parent)."""
        if not self:
            return None
        h = hashlib.blake2b(digest_size=KEY_BYTES, key=_salt(ns_salt), person=_PERSON_SCOPE)
        h.update(_uuid_bytes(model_key))
        for part in (self.adapter, self.salt):
            encoded = part.encode()
            h.update(len(encoded).to_bytes(8, "little"))
            h.update(encoded)
        return uuid.UUID(bytes=h.digest())


def prefix_key(
    *,
    ns_salt: bytes | str,
    model_key: uuid.UUID,
    parent: uuid.UUID | None,
    token_ids: Sequence[int] | np.ndarray,
) -> uuid.UUID:
    """H(ns_salt | model_key | parent_prefix_key | token_ids): position-exact, chained, so a block
    only matches when every block before it matched too. `parent` is None for a first block."""
    tokens = encode_tokens(token_ids)
    if not tokens:
        raise ValueError("a block has at least one token")
    parent_bytes = _uuid_bytes(parent if parent is not None else ROOT_PARENT)
    return uuid.UUID(bytes=_prefix_key_raw(_salt(ns_salt), _uuid_bytes(model_key), parent_bytes, tokens))


def content_key(
    *,
    ns_salt: bytes | str,
    model_key: uuid.UUID,
    token_ids: Sequence[int] | np.ndarray,
    root: uuid.UUID | None = None,
) -> uuid.UUID:
    """H(ns_salt | model_key | [scope root] | token_ids): position-independent, finds a fragment
    anywhere; `root` is the request's `KeyScope.root` (None: no scope)."""
    tokens = encode_tokens(token_ids)
    if not tokens:
        raise ValueError("a block has at least one token")
    scope = _uuid_bytes(root) if root is not None else b""
    return uuid.UUID(bytes=_content_key_raw(_salt(ns_salt), _uuid_bytes(model_key), tokens, scope))


@dataclasses.dataclass(frozen=True)
class BlockFingerprint:
    """The keys of one full block of a prompt."""

    index: int
    start: int
    """Offset of the block's first token in the prompt."""
    prefix_key: uuid.UUID
    content_key: uuid.UUID


def fingerprint_prompt(
    token_ids: Sequence[int] | np.ndarray,
    *,
    ns_salt: bytes | str,
    model_key: uuid.UUID,
    block_tokens: int,
    parent: uuid.UUID | None = None,
    root: uuid.UUID | None = None,
) -> list[BlockFingerprint]:
    """Keys of every full block of a prompt in one call; a partial trailing block has no key.
    `parent` continues a chain (the prefix key of the block just before `token_ids`); `root` is
    the request's `KeyScope.root`: the first block's parent when no `parent` is given, and part
    of every content key."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    encoded = encode_tokens(token_ids)
    salt, model = _salt(ns_salt), _uuid_bytes(model_key)
    scope = _uuid_bytes(root) if root is not None else b""
    start = parent if parent is not None else root
    chain = _uuid_bytes(start if start is not None else ROOT_PARENT)
    stride = 4 * block_tokens
    result = []
    for index in range(len(encoded) // stride):
        tokens = encoded[index * stride : (index + 1) * stride]
        chain = _prefix_key_raw(salt, model, chain, tokens)
        result.append(
            BlockFingerprint(
                index=index,
                start=index * block_tokens,
                prefix_key=uuid.UUID(bytes=chain),
                content_key=uuid.UUID(bytes=_content_key_raw(salt, model, tokens, scope)),
            )
        )
    return result


@dataclasses.dataclass(frozen=True)
class Fingerprinter:
    """Fingerprints prompts of one model in one namespace, under one key scope (`root`: the
    scope's `KeyScope.root`, None for none)."""

    ns_salt: bytes
    model_key: uuid.UUID
    block_tokens: int
    root: uuid.UUID | None = None

    @classmethod
    def for_profile(
        cls, profile: ModelProfile, *, ns_salt: bytes | str, scope: KeyScope | None = None
    ) -> Fingerprinter:
        key = model_key(profile)
        root = scope.root(ns_salt=ns_salt, model_key=key) if scope else None
        return cls(ns_salt=_salt(ns_salt), model_key=key, block_tokens=profile.block_tokens, root=root)

    def scoped(self, scope: KeyScope | None) -> Fingerprinter:
        """This fingerprinter under `scope` (itself when there is none)."""
        if not scope:
            return self
        return dataclasses.replace(self, root=scope.root(ns_salt=self.ns_salt, model_key=self.model_key))

    def blocks(
        self, token_ids: Sequence[int] | np.ndarray, *, parent: uuid.UUID | None = None
    ) -> list[BlockFingerprint]:
        return fingerprint_prompt(
            token_ids,
            ns_salt=self.ns_salt,
            model_key=self.model_key,
            block_tokens=self.block_tokens,
            parent=parent,
            root=self.root,
        )

    def prefix_keys(self, token_ids: Sequence[int] | np.ndarray) -> list[uuid.UUID]:
        return [fp.prefix_key for fp in self.blocks(token_ids)]
