"""StrataConnector inside a real vLLM: hits from every tier give vLLM's own greedy tokens, a bad block
is recomputed and quarantined, namespaces stay apart, vLLM's own cache goes first, preempted requests
leave nothing behind, and serving goes on without Redis (real PostgreSQL, Redis and vLLM processes)."""

from __future__ import annotations

import json
import random
import statistics
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BLOCK = 256


def prompt_of(tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 259) for _ in range(tokens - 1)]


def generate(
    llm: Any,
    prompt: list[int],
    *,
    salt: str | None = None,
    max_tokens: int = 8,
    params: dict[str, Any] | None = None,
) -> tuple[list[int], int]:
    """Greedy tokens and the prompt tokens vLLM did not compute (its own cache plus Strata's);
    `params` are the request's kv_transfer_params."""
    from vllm import SamplingParams

    request: dict[str, Any] = {"prompt_token_ids": prompt}
    if salt is not None:
        request["cache_salt"] = salt
    sampling = SamplingParams(
        max_tokens=max_tokens, temperature=0, extra_args={"kv_transfer_params": params} if params else None
    )
    out = llm.generate([request], sampling, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


def fresh(llm: Any, prompt: list[int], **kwargs: Any) -> tuple[list[int], int]:
    """`generate` with vLLM's own prefix cache emptied first: whatever is reused comes from Strata."""
    assert llm.reset_prefix_cache()
    return generate(llm, prompt, **kwargs)


def status(node: Any, path: str) -> bytes:
    request = urllib.request.Request(
        f"http://127.0.0.1:{node.extra['status_port']}{path}",
        headers={"Authorization": f"Bearer {node.extra['node_admin_key']}"},
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return bytes(answer.read())


def newest(node: Any) -> dict[str, Any]:
    return json.loads(status(node, "/v1/strata/requests"))["requests"][0]


def metric(node: Any, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(status(node, "/metrics").decode()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


@pytest.fixture(scope="module")
def profile(node) -> Any:
    from worker.dataplane.models.loading import checkpoint_profile

    return checkpoint_profile(node.checkpoint, dtype="float32", block_tokens=BLOCK)


@pytest.fixture(scope="module")
def store(node, profile) -> Iterator[Any]:
    """The node's tiers opened by the test: the same host pool, disk directory and remote prefix."""
    from worker.dataplane.store import build_store

    opened = build_store(node.config(), profile=profile, environ={})
    yield opened
    opened.close()


def keys_of(profile: Any, prompt: list[int], namespace: str = "default") -> list[uuid.UUID]:
    from controlplane.directory.models import Namespace
    from worker.dataplane.hashing import Fingerprinter

    salt = Namespace.objects.get(name=namespace).salt_bytes
    return Fingerprinter.for_profile(profile, ns_salt=salt).prefix_keys(prompt)


def move(store: Any, profile: Any, node: Any, keys: list[uuid.UUID], *, source: str, target: str) -> None:
    """Move blocks between the node's tiers as a movement does: copy (verified), record the new
    copy, forget the old one."""
    from controlplane.directory.services import blocks_register, placements_change
    from worker.dataplane.directory import BlockRegistration, PlacementChange
    from worker.dataplane.hashing import model_key
    from worker.dataplane.layout import block_layout

    registrations, changes = [], []
    for index, key in enumerate(keys):
        copied = store.copy(key, source=source, target=target)
        store.delete(key, tier=source)
        registrations.append(
            BlockRegistration(
                namespace="default",
                model_key=model_key(profile),
                prefix_key=key,
                content_key=uuid.uuid4(),
                position=index * BLOCK,
                tokens=BLOCK,
                tier=target,
                node=None if target == "remote" else node.name,
                nbytes=block_layout(profile).block_bytes,
                checksum=copied.checksum.hex,
            )
        )
        changes.append(
            PlacementChange(
                namespace="default",
                model_key=model_key(profile),
                prefix_key=key,
                tier=source,
                node=None if source == "remote" else node.name,
                action="delete",
            )
        )
    blocks_register(registrations=registrations)
    placements_change(changes=changes)


def placements(node: Any, keys: list[uuid.UUID], tier: str, state: str = "ready") -> int:
    from controlplane.directory.models import Placement

    rows = Placement.objects.filter(block__prefix_key__in=keys, tier=tier, state=state)
    return rows.filter(node__isnull=True).count() if tier == "remote" else rows.filter(node__name=node.name).count()


def test_hits_from_host_disk_and_remote_give_vllm_s_own_tokens(plain, strata, node, store, profile):
    prompt = prompt_of(5 * BLOCK + 20, seed=1)
    want, _ = generate(plain, prompt)
    cold, cached = fresh(strata, prompt)
    assert (cold, cached) == (want, 0)
    keys = keys_of(profile, prompt)
    # Written back to the host tier and registered in one batch, behind the request.
    wait_for(lambda: placements(node, keys, "host") == 5, timeout=30, what="the 5 blocks registered on host")
    assert newest(node)["written_blocks"] == 5
    for tier in ("host", "disk", "remote"):
        if tier == "disk":
            move(store, profile, node, keys, source="host", target="disk")
        elif tier == "remote":
            move(store, profile, node, keys, source="disk", target="remote")
        got, cached = fresh(strata, prompt)
        assert got == want, f"a hit from {tier} changed the tokens"
        assert cached == 5 * BLOCK
        trace = newest(node)
        assert trace["hit_blocks_by_tier"] == {tier: 5} and trace["prefix_tokens"] == 5 * BLOCK
        assert trace["load_failures"] == 0
        if tier == "host":  # loaded layer by layer inside the step: a stall per layer
            assert len(trace["layer_stall_s"]) == profile.layers
        else:  # loaded outside the step (async_load_tiers: disk, remote), the request waiting meanwhile
            assert trace["layer_stall_s"] == [] and trace["load_s"] > 0
        assert trace["ttft_s"] > 0 and trace["decision"] == "load"
    assert metric(node, "strata_hit_blocks_total", tier="remote") >= 5


def test_a_corrupt_or_vanished_block_is_recomputed_counted_and_quarantined(plain, strata, node, store, profile):
    prompt = prompt_of(4 * BLOCK + 9, seed=2)
    want, _ = generate(plain, prompt)
    assert fresh(strata, prompt)[0] == want
    keys = keys_of(profile, prompt)
    wait_for(lambda: placements(node, keys, "host") == 4, timeout=30, what="the blocks registered on host")
    move(store, profile, node, keys, source="host", target="disk")
    failures = metric(node, "strata_load_failures_total")
    path = store.tier("disk").path_of(keys[2])
    with open(path, "r+b") as blob:  # one flipped bit in the block's last bytes
        blob.seek(-100, 2)
        byte = blob.read(1)
        blob.seek(-100, 2)
        blob.write(bytes([byte[0] ^ 0x10]))
    got, _ = fresh(strata, prompt)
    assert got == want, "a corrupt block must be recomputed, never served"
    assert newest(node)["load_failures"] == 1
    assert metric(node, "strata_load_failures_total") == failures + 1
    # The bad copy is marked corrupt at once (and its bytes dropped by the tier).
    wait_for(
        lambda: placements(node, keys[2:3], "disk", state="corrupt") == 1,
        timeout=30,
        what="the corrupt copy quarantined",
    )
    assert not store.tier("disk").contains(keys[2])
    # The recomputed blocks are stored again: the next request finds all of them.
    got, cached = fresh(strata, prompt)
    assert got == want and cached == 4 * BLOCK

    # A block the directory places in the remote tier whose bytes are gone: a miss, recomputed.
    again = prompt_of(3 * BLOCK + 5, seed=3)
    want, _ = generate(plain, again)
    assert fresh(strata, again)[0] == want
    keys = keys_of(profile, again)
    wait_for(lambda: placements(node, keys, "host") == 3, timeout=30, what="the blocks registered on host")
    move(store, profile, node, keys, source="host", target="remote")
    store.tier("remote").delete(keys[1])
    got, cached = fresh(strata, again)
    assert got == want
    assert newest(node)["load_failures"] == 1
    assert metric(node, "strata_load_failures_total") == failures + 2


def claim(namespace: str) -> dict[str, Any]:
    """kv_transfer_params naming a namespace (honoured: this node allows client namespaces)."""
    return {"strata_namespace": namespace}


def timed(llm: Any, prompt: list[int], **kwargs: Any) -> tuple[list[int], int, float]:
    """`fresh` with max_tokens 1, and its wall time (the request's TTFT as its client sees it)."""
    started = time.perf_counter()
    tokens, cached = fresh(llm, prompt, max_tokens=1, **kwargs)
    return tokens, cached, time.perf_counter() - started


def test_a_tenant_without_the_salt_gets_nothing_and_a_probe_looks_cold(plain, strata, node, record_property):
    """Tenant A names tenant B's namespace (the operator allowed client namespaces) but lacks B's
    salt: it is served cold, no faster than a cold prompt, and B still hits."""
    prompt = prompt_of(5 * BLOCK + 40, seed=4)
    want, _ = generate(plain, prompt, max_tokens=1)
    b_salt = "tenant b's secret, c2VjcmV0"
    assert timed(strata, prompt, salt=b_salt, params=claim("tenant-b"))[:2] == (want, 0)
    colds = [timed(strata, prompt_of(5 * BLOCK + 40, seed=400 + i), params=claim("tenant-b"))[2] for i in range(5)]
    hits, probes = [], []
    for attempt in range(3):
        # Each probe is cold and stores its own blocks (under its own salt, or none): the next
        # probe comes with another guess, as a prober's would.
        salt = None if attempt == 0 else f"a guess at b's salt {attempt}"
        tokens, cached, seconds = timed(strata, prompt, salt=salt, params=claim("tenant-b"))
        assert (tokens, cached) == (want, 0), f"a tenant without the salt must not hit: {newest(node)}"
        probes.append(seconds)
        tokens, cached, seconds = timed(strata, prompt, salt=b_salt, params=claim("tenant-b"))
        assert (tokens, cached) == (want, 5 * BLOCK), "tenant b, with its salt, still hits"
        hits.append(seconds)
    assert newest(node)["namespace"] == "tenant-b"
    # The probe's TTFT is a cold prompt's, not a hit's: nothing to learn from it.
    probe, hit = statistics.median(probes), statistics.median(hits)
    for name, values in (("cold_ttft_s", colds), ("probe_ttft_s", probes), ("hit_ttft_s", hits)):
        record_property(name, [round(v, 4) for v in values])
    assert 0.8 * min(colds) <= probe <= 1.25 * max(colds), (probes, colds)
    assert probe > 1.5 * hit, (probes, hits)
    # A salt is any string vLLM takes (base64 too), registered nowhere; a namespace claim that is no
    # namespace name is served uncached and counted.
    other = prompt_of(2 * BLOCK + 5, seed=44)
    want, _ = generate(plain, other)
    for salt in ("c2VjcmV0L3RlbmFudD0/Kys=", "not a namespace name!"):
        assert fresh(strata, other, salt=salt) == (want, 0)
        assert fresh(strata, other, salt=salt) == (want, 2 * BLOCK)
    uncached = metric(node, "strata_uncached_requests_total", reason="namespace")
    assert fresh(strata, other, params=claim("not a namespace!")) == (want, 0)
    assert metric(node, "strata_uncached_requests_total", reason="namespace") == uncached + 1


def test_a_prompt_vllm_holds_already_loads_nothing(plain, strata, node):
    prompt = prompt_of(4 * BLOCK + 3, seed=5)
    want, _ = generate(plain, prompt)
    assert fresh(strata, prompt)[0] == want
    hits = metric(node, "strata_hit_tokens_total")
    got, cached = generate(strata, prompt)  # vLLM's own prefix cache still holds it
    assert got == want and cached >= 4 * BLOCK
    trace = newest(node)
    assert trace["prefix_tokens"] == 0 and trace["hit_blocks_by_tier"] == {}
    assert metric(node, "strata_hit_tokens_total") == hits


def test_preempted_requests_load_again_and_leave_nothing_behind(plain, strata, node, store):
    from vllm import SamplingParams

    prompts = [prompt_of(5 * BLOCK + 7, seed=10 + i) for i in range(6)]
    for prompt in prompts:
        fresh(strata, prompt, max_tokens=1)  # stored: the burst below loads them
    assert strata.reset_prefix_cache()
    preempted = _preemptions(strata)
    params = SamplingParams(max_tokens=600, temperature=0, ignore_eos=True)
    # Six requests that outgrow the 64 pages while decoding: vLLM preempts some of them, and
    # each comes back through a new lookup and a new load.
    requests = [{"prompt_token_ids": p} for p in prompts]
    got = [list(o.outputs[0].token_ids) for o in strata.generate(requests, params, use_tqdm=False)]
    want = [list(o.outputs[0].token_ids) for o in plain.generate(requests, params, use_tqdm=False)]
    assert got == want
    assert _preemptions(strata) > preempted, "the burst was meant to preempt"
    wait_for(lambda: metric(node, "strata_connector_requests") == 0, timeout=10, what="no request followed")
    assert metric(node, "strata_connector_lookups_in_flight") == 0
    host = store.tier("host").usage()
    assert host.pending_bytes == 0, "a slot left half-written"


def _preemptions(llm: Any) -> float:
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def test_serving_goes_on_when_redis_stops(plain, strata, node, store, profile):
    prompt = prompt_of(3 * BLOCK + 11, seed=6)
    want, _ = generate(plain, prompt)
    assert fresh(strata, prompt)[0] == want
    keys = keys_of(profile, prompt)
    wait_for(lambda: placements(node, keys, "host") == 3, timeout=30, what="the blocks registered on host")
    move(store, profile, node, keys, source="host", target="remote")
    node.remote.stop()
    try:
        got, cached = fresh(strata, prompt)
        assert got == want and newest(node)["load_failures"] == 1
        other = prompt_of(2 * BLOCK + 1, seed=7)
        assert fresh(strata, other)[0] == generate(plain, other)[0]
    finally:
        node.remote.start()


def test_serving_goes_on_while_postgresql_refuses_connections(plain, strata, node, profile):
    from django.db import connection

    held = prompt_of(3 * BLOCK + 13, seed=8)
    want, _ = generate(plain, held)
    assert fresh(strata, held)[0] == want
    keys = keys_of(profile, held)
    wait_for(lambda: placements(node, keys, "host") == 3, timeout=30, what="the blocks registered on host")
    new = prompt_of(2 * BLOCK + 30, seed=9)
    new_want, _ = generate(plain, new)
    new_keys = keys_of(profile, new)
    settings = connection.settings_dict
    database = connection.ops.quote_name(settings["NAME"])
    # The outage as vLLM's processes see it: their connections dropped, new ones refused (the
    # database can only be closed from another one; this test's own connection stays).
    maintenance = psycopg.connect(
        dbname="postgres",
        host=settings["HOST"] or None,
        port=settings["PORT"] or None,
        user=settings["USER"],
        password=settings["PASSWORD"] or None,
        autocommit=True,
    )
    maintenance.execute(f"ALTER DATABASE {database} ALLOW_CONNECTIONS false")
    maintenance.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> %s",
        (settings["NAME"], connection.connection.info.backend_pid),
    )
    try:
        got, cached = fresh(strata, held)  # the node's own tiers answer without the directory
        assert (got, cached) == (want, 3 * BLOCK)
        assert newest(node)["hit_blocks_by_tier"] == {"host": 3}
        failures = metric(node, "strata_lookup_failures_total")
        assert fresh(strata, new) == (new_want, 0)  # its lookup needs the directory: a miss
        assert metric(node, "strata_lookup_failures_total") > failures
    finally:
        maintenance.execute(f"ALTER DATABASE {database} ALLOW_CONNECTIONS true")
        maintenance.close()
    # What was saved meanwhile is registered once the database answers again: nothing is lost.
    wait_for(lambda: placements(node, new_keys, "host") == 2, timeout=90, what="the outage's blocks registered")
    assert fresh(strata, new) == (new_want, 2 * BLOCK)
