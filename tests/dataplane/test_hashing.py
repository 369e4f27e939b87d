"""Fingerprints: chained prefix keys, position-free content keys, stable across processes."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from worker.dataplane.hashing import (
    Fingerprinter,
    content_key,
    fingerprint_prompt,
    model_key,
    prefix_key,
)
from worker.dataplane.layout import ModelProfile

PROFILE = ModelProfile(
    model_id="meta-llama/Meta-Llama-3-8B",
    revision="abc123",
    dtype="bf16",
    layers=32,
    kv_heads=8,
    head_dim=128,
    block_tokens=4,
    rope_theta=500000.0,
)
SALT = b"tenant-a"
REPO = Path(__file__).resolve().parents[2]

_SCRIPT = """
import json, sys
sys.path.insert(0, {repo!r})
from worker.dataplane.hashing import fingerprint_prompt, model_key
from worker.dataplane.layout import ModelProfile
profile = ModelProfile(model_id="meta-llama/Meta-Llama-3-8B", revision="abc123", dtype="bf16",
                       layers=32, kv_heads=8, head_dim=128, block_tokens=4, rope_theta=500000.0)
tokens = list(range(1000, 1011))
fps = fingerprint_prompt(tokens, ns_salt=b"tenant-a", model_key=model_key(profile), block_tokens=4)
print(json.dumps([model_key(profile).hex] + [[f.prefix_key.hex, f.content_key.hex] for f in fps]))
"""


def _fingerprints_in_subprocess(hash_seed: str) -> list:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT.format(repo=str(REPO))],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return json.loads(out.stdout)


def test_stable_across_processes_and_hash_seeds() -> None:
    first = _fingerprints_in_subprocess("1")
    second = _fingerprints_in_subprocess("4242")
    assert first == second
    here = fingerprint_prompt(list(range(1000, 1011)), ns_salt=SALT, model_key=model_key(PROFILE), block_tokens=4)
    assert first == [model_key(PROFILE).hex] + [[f.prefix_key.hex, f.content_key.hex] for f in here]


def test_golden_values_do_not_drift() -> None:
    # Keys are persisted (PostgreSQL uuid, file names, Redis keys): a change here orphans them.
    mk = model_key(PROFILE)
    first = prefix_key(ns_salt=SALT, model_key=mk, parent=None, token_ids=[1, 2, 3, 4])
    assert mk == uuid.UUID("c13d6d8a-3ad0-0dd7-8cc0-f59fb52e3d04")
    assert first == uuid.UUID("fb1fe913-bb46-f514-2845-cf29daad2957")
    assert content_key(ns_salt=SALT, model_key=mk, token_ids=[1, 2, 3, 4]) == uuid.UUID(
        "185b7619-903e-d05a-951c-291531bafffd"
    )


def test_helper_matches_the_chain_and_drops_the_partial_block() -> None:
    mk = model_key(PROFILE)
    tokens = list(range(50, 61))  # two full blocks of 4 and a partial one of 3
    fps = fingerprint_prompt(tokens, ns_salt=SALT, model_key=mk, block_tokens=4)
    assert [fp.start for fp in fps] == [0, 4]
    parent = None
    for fp in fps:
        block = tokens[fp.start : fp.start + 4]
        expected = prefix_key(ns_salt=SALT, model_key=mk, parent=parent, token_ids=block)
        assert fp.prefix_key == expected
        assert fp.content_key == content_key(ns_salt=SALT, model_key=mk, token_ids=block)
        parent = expected
    assert fingerprint_prompt(tokens[:3], ns_salt=SALT, model_key=mk, block_tokens=4) == []


def test_chaining_order_matters_for_prefix_keys_not_content_keys() -> None:
    mk = model_key(PROFILE)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    ab = fingerprint_prompt(a + b, ns_salt=SALT, model_key=mk, block_tokens=4)
    ba = fingerprint_prompt(b + a, ns_salt=SALT, model_key=mk, block_tokens=4)
    assert ab[1].prefix_key != ba[0].prefix_key  # block b after a is not block b first
    assert ab[1].content_key == ba[0].content_key  # ...but it is the same content
    assert ab[0].content_key == ba[1].content_key
    assert len({fp.prefix_key for fp in ab + ba}) == 4


def test_continuing_a_chain_equals_fingerprinting_at_once() -> None:
    mk = model_key(PROFILE)
    tokens = list(range(16))
    whole = fingerprint_prompt(tokens, ns_salt=SALT, model_key=mk, block_tokens=4)
    head = fingerprint_prompt(tokens[:8], ns_salt=SALT, model_key=mk, block_tokens=4)
    tail = fingerprint_prompt(tokens[8:], ns_salt=SALT, model_key=mk, block_tokens=4, parent=head[-1].prefix_key)
    assert [f.prefix_key for f in whole] == [f.prefix_key for f in head + tail]


def test_namespaces_are_isolated() -> None:
    mk = model_key(PROFILE)
    tokens = [9, 8, 7, 6]
    assert prefix_key(ns_salt=b"a", model_key=mk, parent=None, token_ids=tokens) != prefix_key(
        ns_salt=b"b", model_key=mk, parent=None, token_ids=tokens
    )
    assert content_key(ns_salt=b"a", model_key=mk, token_ids=tokens) != content_key(
        ns_salt=b"b", model_key=mk, token_ids=tokens
    )
    with pytest.raises(ValueError):
        prefix_key(ns_salt=b"x" * 65, model_key=mk, parent=None, token_ids=tokens)


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "other"},
        {"revision": "def456"},
        {"dtype": "float16"},
        {"layers": 31},
        {"kv_heads": 4},
        {"head_dim": 64},
        {"block_tokens": 8},
        {"rope_theta": 10000.0},
        {"rope_scaling": ModelProfile.canonical_rope_scaling({"type": "llama3", "factor": 8.0})},
    ],
)
def test_model_key_covers_everything_that_changes_the_bytes(change: dict) -> None:
    assert model_key(dataclasses.replace(PROFILE, **change)) != model_key(PROFILE)


def test_token_containers_and_validation() -> None:
    mk = model_key(PROFILE)
    ids = [3, 1, 4, 1]
    want = prefix_key(ns_salt=SALT, model_key=mk, parent=None, token_ids=ids)
    for container in (
        np.array(ids, dtype=np.int64),
        np.array(ids, dtype=np.uint32),
        torch.tensor(ids),
    ):
        assert prefix_key(ns_salt=SALT, model_key=mk, parent=None, token_ids=container) == want
    with pytest.raises(ValueError):
        prefix_key(ns_salt=SALT, model_key=mk, parent=None, token_ids=[-1, 2])
    with pytest.raises(TypeError):
        prefix_key(ns_salt=SALT, model_key=mk, parent=None, token_ids=[1.5, 2.0])
    with pytest.raises(ValueError):
        prefix_key(ns_salt=SALT, model_key=mk, parent=None, token_ids=[])


def test_fingerprinter_binds_a_namespace_and_a_model() -> None:
    fingerprinter = Fingerprinter.for_profile(PROFILE, ns_salt="tenant-a")
    tokens = list(range(12))
    assert fingerprinter.prefix_keys(tokens) == [
        fp.prefix_key for fp in fingerprint_prompt(tokens, ns_salt=SALT, model_key=model_key(PROFILE), block_tokens=4)
    ]


def test_a_key_scope_changes_every_key_and_no_scope_changes_none():
    from worker.dataplane.hashing import Fingerprinter, KeyScope

    model = uuid.uuid4()
    tokens = list(range(1, 4 * 16 + 1))
    plain = Fingerprinter(ns_salt=b"ns", model_key=model, block_tokens=16)
    assert plain.scoped(None) is plain and plain.scoped(KeyScope()) is plain
    assert KeyScope().root(ns_salt=b"ns", model_key=model) is None
    scopes = [KeyScope(salt="s"), KeyScope(salt="t"), KeyScope(adapter="a@1"), KeyScope(adapter="a@2", salt="s")]
    printed = [plain.blocks(tokens)] + [plain.scoped(scope).blocks(tokens) for scope in scopes]
    for kind in ("prefix_key", "content_key"):
        keys = [getattr(fp, kind) for blocks in printed for fp in blocks]
        assert len(set(keys)) == len(keys), f"{kind}s of different scopes must all differ"
    # The same scope gives the same keys (another process, another node); the chain starts at its root.
    again = Fingerprinter(ns_salt=b"ns", model_key=model, block_tokens=16).scoped(KeyScope(salt="s"))
    assert again.blocks(tokens) == printed[1]
    root = KeyScope(salt="s").root(ns_salt=b"ns", model_key=model)
    assert printed[1][0].prefix_key == prefix_key(ns_salt=b"ns", model_key=model, parent=root, token_ids=tokens[:16])
    # The adapter and the salt are length-delimited: moving a character between them is another scope.
    assert KeyScope(adapter="ab", salt="c").root(ns_salt=b"ns", model_key=model) != KeyScope(
        adapter="a", salt="bc"
    ).root(ns_salt=b"ns", model_key=model)
