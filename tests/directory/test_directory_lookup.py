"""Hit detection: one query per lookup, chain order, best tier per node, READY copies only, namespaces."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from controlplane.directory.errors import UnknownModel, UnknownNamespace, UnknownNode
from controlplane.directory.models import Placement
from controlplane.directory.selectors import blocks_lookup
from controlplane.directory.services import blocks_register, namespace_create
from tests.directory.conftest import NamespaceFactory
from worker.dataplane.hashing import fingerprint_prompt

pytestmark = pytest.mark.django_db


def _chain(registration, count, **overrides):
    """`count` chained blocks registered on the host tier of gpu-0; returns their registrations."""
    regs = [registration(position=16 * i, **overrides) for i in range(count)]
    blocks_register(registrations=regs)
    return regs


def test_lookup_answers_in_chain_order_in_one_query(registration, profile, django_assert_num_queries):
    regs = _chain(registration, 5)
    unknown = uuid.uuid4()
    keys = [r.prefix_key for r in regs[:3]] + [unknown] + [r.prefix_key for r in regs[3:]]
    with django_assert_num_queries(1):
        result = blocks_lookup(namespace="tenant-a", model_key=profile.model_key, node="gpu-0", prefix_keys=keys)
    assert [loc.key if loc else None for loc in result.prefix] == keys[:3] + [None] + keys[4:]
    assert [loc.position for loc in result.prefix if loc] == [0, 16, 32, 48, 64]
    assert result.prefix_hit_blocks == 3
    assert result.hits == 5
    first = result.prefix[0]
    assert first is not None
    assert (first.tier, first.node, first.tokens, first.nbytes, first.epoch) == (
        "host",
        "gpu-0",
        16,
        profile.block_bytes,
        1,
    )
    # The result is also a key -> tier mapping (what the engine's BlockIndex protocol expects).
    assert dict(result) == {k: "host" for k in keys if k != unknown}


def test_empty_lookup_is_one_query_with_no_hits(profile, namespace, django_assert_num_queries):
    with django_assert_num_queries(1):
        result = blocks_lookup(namespace="tenant-a", model_key=profile.model_key, node=None, prefix_keys=[])
    assert result.prefix == () and result.hits == 0 and len(result) == 0


def test_best_tier_for_the_asking_node(registration, profile, node, other_node):
    key = uuid.uuid4()
    content = uuid.uuid4()
    # One block, four copies: gpu-1's device, gpu-0's disk and host, and the shared remote tier.
    blocks_register(
        registrations=[
            registration(prefix_key=key, content_key=content, tier="device", node="gpu-1"),
            registration(prefix_key=key, content_key=content, tier="disk", node="gpu-0", locator="/nvme/a"),
            registration(prefix_key=key, content_key=content, tier="host", node="gpu-0", locator="slot:7"),
            registration(prefix_key=key, content_key=content, tier="remote", node=None, locator="strata:k"),
        ]
    )

    def best(asking):
        loc = blocks_lookup(namespace="tenant-a", model_key=profile.model_key, node=asking, prefix_keys=[key]).prefix[0]
        return (loc.tier, loc.node, loc.locator) if loc else None

    assert best("gpu-0") == ("host", "gpu-0", "slot:7")
    assert best("gpu-1") == ("device", "gpu-1", "")
    assert best("gpu-9") == ("remote", None, "strata:k")  # a node the directory does not know: shared tier only
    assert best(None) == ("device", "gpu-1", "")  # no node: the fastest copy anywhere


@pytest.mark.parametrize("state", ["pending", "corrupt", "deleting"])
def test_only_ready_copies_are_served(registration, profile, state):
    reg = registration()
    blocks_register(
        registrations=[
            reg,
            registration(prefix_key=reg.prefix_key, content_key=reg.content_key, tier="remote", node=None),
        ]
    )
    Placement.objects.filter(tier="host").update(state=state)
    loc = blocks_lookup(
        namespace="tenant-a", model_key=profile.model_key, node="gpu-0", prefix_keys=[reg.prefix_key]
    ).prefix[0]
    assert loc is not None and loc.tier == "remote"
    Placement.objects.filter(tier="remote").update(state=state)
    assert blocks_lookup(
        namespace="tenant-a", model_key=profile.model_key, node="gpu-0", prefix_keys=[reg.prefix_key]
    ).prefix == (None,)


def test_every_hit_names_the_checksum_registered_for_its_remote_copy(registration, profile, django_assert_num_queries):
    """What a node must find in a copy it reads from L3 comes in the same round trip: the remote
    copy's checksum, also when the best copy is the asking node's own (which its tiers may have
    dropped since: the node then reads L3 and checks against it)."""
    stale, remote_only, local_only, content = uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    blocks_register(
        registrations=[
            registration(prefix_key=stale, content_key=content, tier="host", checksum="a" * 32),
            registration(prefix_key=stale, content_key=content, tier="remote", node=None, checksum="b" * 32),
            registration(prefix_key=remote_only, tier="remote", node=None, checksum="c" * 32),
            registration(prefix_key=local_only, tier="disk", checksum="d" * 32),
        ]
    )
    ask = dict(namespace="tenant-a", model_key=profile.model_key)
    with django_assert_num_queries(1):
        result = blocks_lookup(
            **ask, node="gpu-0", prefix_keys=[stale, remote_only, local_only, uuid.uuid4()], content_keys=[content]
        )
    assert [(loc.tier, loc.checksum, loc.remote_checksum) for loc in result.prefix if loc] == [
        ("host", "a" * 32, "b" * 32),
        ("remote", "c" * 32, "c" * 32),
        ("disk", "d" * 32, ""),
    ]
    assert result.prefix[3] is None
    fragment = result.content[0]
    assert fragment is not None and (fragment.tier, fragment.remote_checksum) == ("host", "b" * 32)
    # Another node's best copy is the remote one itself.
    other = blocks_lookup(**ask, node="gpu-9", prefix_keys=[stale]).prefix[0]
    assert other is not None and (other.tier, other.checksum, other.remote_checksum) == ("remote", "b" * 32, "b" * 32)
    # A remote copy that is not READY (quarantined, being written or deleted) vouches for nothing.
    for state in ("corrupt", "pending", "deleting"):
        Placement.objects.filter(tier="remote", checksum="b" * 32).update(state=state)
        again = blocks_lookup(**ask, node="gpu-0", prefix_keys=[stale]).prefix[0]
        assert again is not None and (again.tier, again.remote_checksum) == ("host", "")


def test_content_keys_find_a_fragment_anywhere(registration, profile):
    regs = _chain(registration, 3)
    asked = [uuid.uuid4(), regs[2].content_key]
    result = blocks_lookup(
        namespace="tenant-a", model_key=profile.model_key, node="gpu-0", prefix_keys=[uuid.uuid4()], content_keys=asked
    )
    assert result.prefix == (None,)
    assert result.content[0] is None
    hit = result.content[1]
    assert hit is not None and hit.key == regs[2].content_key and hit.prefix_key == regs[2].prefix_key
    assert hit.position == 32


def test_model_key_must_match(registration, profile):
    reg = _chain(registration, 1)[0]
    result = blocks_lookup(namespace="tenant-a", model_key=uuid.uuid4(), node="gpu-0", prefix_keys=[reg.prefix_key])
    assert result.prefix == (None,)


def test_namespace_isolation_with_identical_tokens(registration, profile, namespace, other_namespace):
    tokens = np.arange(64, dtype=np.uint32)
    fp_a = fingerprint_prompt(tokens, ns_salt=namespace.salt_bytes, model_key=profile.model_key, block_tokens=16)
    fp_b = fingerprint_prompt(tokens, ns_salt=other_namespace.salt_bytes, model_key=profile.model_key, block_tokens=16)
    assert {f.prefix_key for f in fp_a}.isdisjoint({f.prefix_key for f in fp_b})
    blocks_register(
        registrations=[registration(prefix_key=f.prefix_key, content_key=f.content_key, position=f.start) for f in fp_a]
    )
    in_a = blocks_lookup(
        namespace="tenant-a", model_key=profile.model_key, node="gpu-0", prefix_keys=[f.prefix_key for f in fp_a]
    )
    assert in_a.prefix_hit_blocks == 4
    # Tenant B fingerprints the same tokens with its own salt: nothing matches.
    in_b = blocks_lookup(
        namespace="tenant-b",
        model_key=profile.model_key,
        node="gpu-0",
        prefix_keys=[f.prefix_key for f in fp_b],
        content_keys=[f.content_key for f in fp_b],
    )
    assert in_b.hits == 0
    # Even asking with A's very keys from B finds nothing: the namespace is checked, not only the salt.
    stolen = blocks_lookup(
        namespace="tenant-b",
        model_key=profile.model_key,
        node="gpu-0",
        prefix_keys=[f.prefix_key for f in fp_a],
        content_keys=[f.content_key for f in fp_a],
    )
    assert stolen.hits == 0


def test_same_key_in_two_namespaces_is_two_blocks(registration, profile, other_namespace):
    key = uuid.uuid4()
    blocks_register(registrations=[registration(prefix_key=key, locator="a")])
    blocks_register(registrations=[registration(prefix_key=key, namespace="tenant-b", locator="b")])
    for name in ("tenant-a", "tenant-b"):
        loc = blocks_lookup(namespace=name, model_key=profile.model_key, node="gpu-0", prefix_keys=[key]).prefix[0]
        assert loc is not None and loc.locator == name[-1]


def test_shared_namespace_matches_from_any_namespace(registration, profile, namespace):
    common = namespace_create(name="policies", shared=True)
    private = NamespaceFactory(name="tenant-c")
    tokens = np.arange(32, dtype=np.uint32)
    shared_fp = fingerprint_prompt(tokens, ns_salt=common.salt_bytes, model_key=profile.model_key, block_tokens=16)
    private_fp = fingerprint_prompt(tokens, ns_salt=private.salt_bytes, model_key=profile.model_key, block_tokens=16)
    blocks_register(
        registrations=[
            registration(namespace="policies", prefix_key=f.prefix_key, content_key=f.content_key, position=f.start)
            for f in shared_fp
        ]
    )
    blocks_register(
        registrations=[
            registration(namespace="tenant-c", prefix_key=f.prefix_key, content_key=f.content_key, position=f.start)
            for f in private_fp
        ]
    )
    # tenant-a asks with the shared namespace's keys: hits. With tenant-c's keys: a private namespace never matches.
    shared_keys = [f.prefix_key for f in shared_fp]
    private_keys = [f.prefix_key for f in private_fp]
    assert (
        blocks_lookup(
            namespace="tenant-a", model_key=profile.model_key, node="gpu-0", prefix_keys=shared_keys
        ).prefix_hit_blocks
        == 2
    )
    assert (
        blocks_lookup(namespace="tenant-a", model_key=profile.model_key, node="gpu-0", prefix_keys=private_keys).hits
        == 0
    )


def test_strict_lookup_names_what_is_unknown(profile, namespace, node):
    ask = dict(namespace="tenant-a", model_key=profile.model_key, node="gpu-0", prefix_keys=[uuid.uuid4()], strict=True)
    assert blocks_lookup(**ask).hits == 0
    with pytest.raises(UnknownNamespace, match="namespace: no namespace named 'nope'"):
        blocks_lookup(**{**ask, "namespace": "nope"})
    with pytest.raises(UnknownModel, match="model_key"):
        blocks_lookup(**{**ask, "model_key": uuid.uuid4()})
    with pytest.raises(UnknownNode, match="node: no node named 'gpu-7'"):
        blocks_lookup(**{**ask, "node": "gpu-7"})
