"""The connector's scheduler half with a real host tier and stand-ins for vLLM's request objects and
the directory: a lookup that needs a round trip answers "ask again" until it is back, an outage of
the directory is a miss (counted), vLLM's own cache goes first; keys carry the LoRA adapter and
the cache salt, namespaces come from identities the operator controls, requests Strata cannot key
are served uncached and counted, and a promised load is never dropped from a step. The real
directory behind a blackholed path costs one request its lookup deadline and holds no thread."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.support import BlackholeProxy, directory_client, postgres_socket, wait_for
from worker.dataplane.config import load_config
from worker.dataplane.connectors.vllm.runtime import Runtime
from worker.dataplane.connectors.vllm.scheduler_half import SchedulerHalf
from worker.dataplane.connectors.vllm.tenancy import NAMESPACE_PARAM, TAG_PARAM, namespace_tag
from worker.dataplane.directory import DirectoryUnavailable, LookupResult
from worker.dataplane.hashing import KeyScope
from worker.dataplane.layout import ModelProfile, block_layout
from worker.dataplane.offload import OffloadManager
from worker.dataplane.store import build_store

PROFILE = ModelProfile(model_id="sched", layers=2, kv_heads=2, head_dim=8, dtype="float32", block_tokens=32)
SECRET = "namespace-secret-for-tests"


@dataclasses.dataclass
class Request:
    """What the scheduler half reads of vLLM's Request."""

    request_id: str
    prompt_token_ids: list[int] | None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    arrival_time: float = 0.0
    mm_features: list[Any] = dataclasses.field(default_factory=list)
    lora_request: Any = None
    prompt_embeds: Any = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids or []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.all_token_ids)

    num_output_tokens = 0

    finished: bool = False
    status: Any = None
    num_computed_tokens: int = 0

    def is_finished(self) -> bool:
        return self.finished

    def get_finished_reason(self) -> str:
        return "length"


class PrefixCache:
    """What the scheduler half uses of vLLM's KV cache manager: the pages it takes out of the
    prefix cache, and those it puts back."""

    def __init__(self) -> None:
        self.evicted: list[set[int]] = []
        self.tables: dict[str, list[int]] = {}
        self.cached: list[tuple[str, int, int]] = []
        self.block_pool = SimpleNamespace(cache_full_blocks=self.cache_full_blocks)

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.evicted.append(set(block_ids))

    def get_blocks(self, request_id: str) -> Any:
        hashed = set().union(*self.evicted) if self.evicted else set()
        table = [
            SimpleNamespace(block_id=page, block_hash=None if page in hashed else b"h")
            for page in self.tables[request_id]
        ]
        return SimpleNamespace(blocks=(table,))

    def cache_full_blocks(self, request, blocks, first, end, page_tokens, group) -> None:  # noqa: ANN001
        self.cached.append((request.request_id, first, end))


class Directory:
    """A directory whose lookups wait for the test (`release`) or fail as an outage."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.down = False
        self.shared: dict[str, bytes] = {}

    def namespace_salt(self, namespace: str) -> bytes:
        if self.down:
            raise DirectoryUnavailable("the directory database was unreachable a moment ago")
        return namespace.encode()

    def shared_salts(self) -> dict[str, bytes]:
        return dict(self.shared)

    def lookup(self, *, keys, node, namespace=None, model_key=None, content_keys=()):  # noqa: ANN001
        self.release.wait(10)
        if self.down:
            raise DirectoryUnavailable("lookup took over 250 ms")
        return LookupResult(prefix=tuple(None for _ in keys))

    def touch(self, *, touches) -> None:  # noqa: ANN001
        pass


def make_half(tmp_path: Path, shm_name: str, directory: Any = None, **options: Any):
    config = load_config(
        overrides={
            "node_name": "sched",
            "tiers": "host,remote",
            "host_pool_name": shm_name,
            "host_bytes": "1MiB",
            "remote_url": str(tmp_path / "l3"),
            "status_port": 1,
            "namespace_secret": SECRET,
            **options,
        },
        environ={},
    )
    store = build_store(config, profile=PROFILE, environ={})
    directory = directory or Directory()
    manager = OffloadManager(
        store=store,
        profile=PROFILE,
        node="sched",
        directory=directory,  # type: ignore[arg-type]
        write_back_tier="host",
    )
    scheduler = SchedulerHalf(
        Runtime(config=config, profile=PROFILE, store=store, directory=None, manager=manager), page_tokens=16
    )
    scheduler.bind_prefix_cache(PrefixCache())  # type: ignore[arg-type]
    return scheduler, directory, store


@pytest.fixture
def half(tmp_path: Path, shm_name: str):
    scheduler, directory, store = make_half(tmp_path, shm_name)
    yield scheduler, directory
    scheduler.close()
    store.close()


@pytest.fixture
def open_half(tmp_path: Path, shm_name: str):
    """A scheduler half that honours the namespaces clients name (client_namespaces)."""
    scheduler, directory, store = make_half(tmp_path, shm_name, client_namespaces="true")
    yield scheduler, directory
    scheduler.close()
    store.close()


def stored(
    half: SchedulerHalf, request: Request, blocks: int, *, namespace: str = "default", scope: KeyScope | None = None
) -> None:
    """Put the request's first `blocks` blocks, keyed as `namespace` and `scope` key them, in the host tier."""
    keys = half.manager.fingerprinter(namespace, scope).prefix_keys(request.prompt_token_ids)
    for key in keys[:blocks]:
        half.manager.store.put(key, block_layout(PROFILE).empty(), tier="host")


def answer_of(scheduler: SchedulerHalf, request: Request) -> int:
    """matched_tokens once the lookup is back (vLLM asks every step until it is)."""
    for _ in range(200):
        answer = scheduler.matched_tokens(request, 0)
        if answer is not None:
            return answer
        threading.Event().wait(0.01)
    raise AssertionError("the lookup never came back")


def prompt(tokens: int) -> list[int]:
    return [1 + (i * 7) % 250 for i in range(tokens)]


def test_a_lookup_with_a_round_trip_answers_ask_again_until_it_is_back(half):
    scheduler, directory = half
    request = Request(uuid.uuid4().hex, prompt(4 * 32 + 5))
    stored(scheduler, request, 2)  # blocks 2 and 3 must be asked of the directory
    assert scheduler.matched_tokens(request, 0) is None
    assert scheduler.matched_tokens(request, 0) is None  # vLLM asks again the next step
    directory.release.set()
    for _ in range(100):
        answer = scheduler.matched_tokens(request, 0)
        if answer is not None:
            break
        threading.Event().wait(0.01)
    assert answer == 2 * 32
    assert scheduler.requests[request.request_id].trace.decision == "load"


def test_the_node_s_own_tiers_answer_at_once_and_vllm_s_cache_goes_first(half):
    scheduler, _ = half
    request = Request(uuid.uuid4().hex, prompt(3 * 32))
    stored(scheduler, request, 3)
    # Every block is local: no round trip; the last prompt token is always computed.
    assert scheduler.matched_tokens(request, 0) == 3 * 32 - 1
    assert scheduler.matched_tokens(request, 48) == 3 * 32 - 1 - 48
    assert scheduler.matched_tokens(request, 96) == 0  # vLLM's own prefix cache holds it all


def test_an_outage_of_the_directory_is_a_miss_and_counted(half):
    scheduler, directory = half
    directory.down = True
    directory.release.set()
    request = Request(
        uuid.uuid4().hex,
        prompt(2 * 32 + 1),
        kv_transfer_params={NAMESPACE_PARAM: "tenant-new", TAG_PARAM: namespace_tag(SECRET, "tenant-new")},
    )
    answer = scheduler.matched_tokens(request, 0)
    for _ in range(100):
        if answer is not None:
            break
        threading.Event().wait(0.01)
        answer = scheduler.matched_tokens(request, 0)
    assert answer == 0
    assert scheduler.manager.counters.get("lookup_failures") == 1


def test_a_lookup_past_its_deadline_is_a_miss_and_counted(tmp_path: Path, shm_name: str, caplog):
    """A directory that never answers delays the request by lookup_deadline_seconds, no more."""
    scheduler, directory, store = make_half(tmp_path, shm_name, lookup_deadline_seconds="0.2")
    try:
        request = Request(uuid.uuid4().hex, prompt(4 * 32 + 5))
        stored(scheduler, request, 2)  # blocks 2 and 3 must be asked of the directory, which hangs
        assert scheduler.matched_tokens(request, 0) is None
        threading.Event().wait(0.3)
        with caplog.at_level(logging.WARNING, logger="strata.vllm"):
            assert scheduler.matched_tokens(request, 0) == 0
        assert scheduler.manager.counters.get("lookup_deadlines") == 1
        assert scheduler.requests[request.request_id].trace.decision == "no-hit"
        assert any("no lookup answer within lookup_deadline_seconds (0.2 s)" in r.message for r in caplog.records)
        directory.release.set()  # the late answer changes nothing
        assert scheduler.matched_tokens(request, 0) == 0
    finally:
        directory.release.set()
        scheduler.close()
        store.close()


@pytest.mark.django_db(transaction=True)
def test_a_blackholed_directory_costs_one_request_its_deadline_and_holds_no_lookup_thread(
    tmp_path: Path, shm_name: str
):
    """The real directory behind a path that stops answering (packets dropped, no connection
    closed): the request waiting on it is served uncached at lookup_deadline_seconds, the
    directory client cuts that read at its own deadline (a node gives both the same; here the
    read's is later, to tell them apart), and the requests after it are misses at once, so the
    scheduler's lookup threads are not held until TCP gives up."""
    from controlplane.directory.services import namespace_ensure

    namespace_ensure(name="default")
    path = BlackholeProxy(postgres_socket())
    directory = directory_client(path.port, read_deadline_s=1.0, unavailable_s=0.2)
    scheduler, _, store = make_half(tmp_path, shm_name, directory, lookup_deadline_seconds="0.5")

    def answered(request: Request) -> int:
        return wait_for(
            lambda: (answer := scheduler.matched_tokens(request, 0)) is not None and (answer,),
            timeout=5,
            every=0.01,
            what=f"the lookup of {request.request_id}",
        )[0]

    try:
        assert answered(Request("warm", prompt(2 * 32 + 1))) == 0  # the namespace's salt is read
        path.blackhole()
        waiting = Request("waiting", [token + 2 for token in prompt(3 * 32 + 1)])
        began = time.perf_counter()
        assert answered(waiting) == 0
        waited = time.perf_counter() - began
        assert 0.5 <= waited < 0.8, waited
        assert scheduler.manager.counters.get("lookup_deadlines") == 1
        wait_for(lambda: directory.stats().read_deadlines == 1, timeout=5, what="the read cut at its deadline")
        for seed in (3, 4, 5):  # more than the two lookup threads
            began = time.perf_counter()
            assert answered(Request(f"after-{seed}", [token + seed for token in prompt(3 * 32 + 1)])) == 0
            assert time.perf_counter() - began < 0.2
        assert scheduler.manager.counters.get("lookup_deadlines") == 1
        assert scheduler.manager.counters.get("lookup_failures") >= 3
    finally:
        path.restore()
        scheduler.close()
        directory.close(timeout=5)
        path.close()
        store.close()


def test_a_salt_is_any_string_and_a_secret_mixed_into_the_keys(half):
    scheduler, directory = half
    directory.release.set()
    tokens = prompt(3 * 32 + 1)
    salt = "c2VjcmV0L3RlbmFudD0/Kys="  # vLLM clients send base64: no namespace name, a salt all the same
    stored(scheduler, Request("w", tokens), 3, scope=KeyScope(salt=salt))
    assert answer_of(scheduler, Request(uuid.uuid4().hex, tokens, cache_salt=salt)) == 3 * 32
    # The same tokens without the salt, or with another, find nothing: no probing another's prompts.
    assert answer_of(scheduler, Request(uuid.uuid4().hex, tokens)) == 0
    assert answer_of(scheduler, Request(uuid.uuid4().hex, tokens, cache_salt=salt + "x")) == 0
    # The salt is mixed into every key after the first, and into content keys.
    salted = scheduler.manager.fingerprints(tokens, "default", scope=KeyScope(salt=salt))
    plain = scheduler.manager.fingerprints(tokens, "default")
    assert not {fp.prefix_key for fp in salted} & {fp.prefix_key for fp in plain}
    assert not {fp.content_key for fp in salted} & {fp.content_key for fp in plain}
    assert scheduler.manager.counters.get("lookup_failures") == 0


def test_a_claimed_namespace_is_ignored_unless_the_operator_allows_it(half):
    scheduler, directory = half
    directory.release.set()
    tokens = prompt(2 * 32 + 1)
    stored(scheduler, Request("w", tokens), 2, namespace="tenant-b")
    claim = Request(uuid.uuid4().hex, tokens, kv_transfer_params={NAMESPACE_PARAM: "tenant-b"})
    assert answer_of(scheduler, claim) == 0
    assert scheduler.requests[claim.request_id].namespace == "default"
    # A tag forged without the node's secret is a claim like any other.
    forged = Request(
        uuid.uuid4().hex,
        tokens,
        kv_transfer_params={NAMESPACE_PARAM: "tenant-b", TAG_PARAM: namespace_tag("guess", "tenant-b")},
    )
    assert answer_of(scheduler, forged) == 0
    # The middleware's tag (an API key or a trusted gateway's header placed the request) is honoured.
    vouched = Request(
        uuid.uuid4().hex,
        tokens,
        kv_transfer_params={NAMESPACE_PARAM: "tenant-b", TAG_PARAM: namespace_tag(SECRET, "tenant-b")},
    )
    assert answer_of(scheduler, vouched) == 2 * 32
    assert scheduler.requests[vouched.request_id].trace.namespace == "tenant-b"


def test_client_namespaces_honour_a_claim_but_never_give_another_s_salted_blocks(open_half):
    scheduler, directory = open_half
    directory.release.set()
    tokens = prompt(2 * 32 + 1)
    stored(scheduler, Request("w", tokens), 2, namespace="tenant-b", scope=KeyScope(salt="b's secret"))
    own = Request(uuid.uuid4().hex, tokens, cache_salt="b's secret", kv_transfer_params={NAMESPACE_PARAM: "tenant-b"})
    assert answer_of(scheduler, own) == 2 * 32
    other = Request(uuid.uuid4().hex, tokens, kv_transfer_params={NAMESPACE_PARAM: "tenant-b"})
    assert answer_of(scheduler, other) == 0  # tenant b's name without its salt: nothing


@pytest.mark.parametrize("params", [{NAMESPACE_PARAM: "x" * 64}, {NAMESPACE_PARAM: "not a namespace!"}])
def test_a_claim_that_is_no_namespace_is_served_uncached_and_counted(open_half, params):
    scheduler, _ = open_half
    request = Request(uuid.uuid4().hex, prompt(64), kv_transfer_params=params)
    assert scheduler.matched_tokens(request, 0) == 0
    assert scheduler.manager.counters.get("uncached.namespace") == 1
    assert scheduler.requests[request.request_id].trace.uncached == "namespace"
    scheduler.finished(request)  # type: ignore[arg-type]
    assert scheduler.requests == {}


def lora(tmp_path: Path, name: str, weights: bytes) -> SimpleNamespace:
    adapter = tmp_path / name
    adapter.mkdir(exist_ok=True)
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(weights)
    return SimpleNamespace(lora_name=name, lora_int_id=1, lora_path=str(adapter))


def test_the_lora_adapter_and_its_weights_are_part_of_the_keys(half, tmp_path):
    scheduler, directory = half
    directory.release.set()
    tokens = prompt(3 * 32 + 1)
    a, b = lora(tmp_path, "a", b"A" * 4096), lora(tmp_path, "b", b"B" * 4096)
    first = Request(uuid.uuid4().hex, tokens, lora_request=a)
    assert answer_of(scheduler, first) == 0
    stored(scheduler, first, 3, scope=scheduler.requests[first.request_id].scope)
    assert answer_of(scheduler, Request(uuid.uuid4().hex, tokens, lora_request=a)) == 3 * 32
    assert answer_of(scheduler, Request(uuid.uuid4().hex, tokens, lora_request=b)) == 0
    assert answer_of(scheduler, Request(uuid.uuid4().hex, tokens)) == 0  # the base model
    # The same name on other weights (the adapter rewritten in place, its size and mtime kept).
    weights = Path(a.lora_path) / "adapter_model.safetensors"
    stat = weights.stat()
    weights.write_bytes(b"C" * 4096)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert answer_of(scheduler, Request(uuid.uuid4().hex, tokens, lora_request=a)) == 0


def test_requests_strata_cannot_key_are_served_uncached_and_counted(half, tmp_path):
    scheduler, directory = half
    directory.release.set()
    tokens = prompt(2 * 32 + 1)
    stored(scheduler, Request("w", tokens), 2)
    embeds = Request(uuid.uuid4().hex, None, prompt_embeds=object())
    media = Request(uuid.uuid4().hex, tokens, mm_features=[object()])
    missing = Request(
        uuid.uuid4().hex, tokens, lora_request=SimpleNamespace(lora_name="gone", lora_int_id=2, lora_path="/no/such")
    )
    for request in (embeds, media, missing):
        assert answer_of(scheduler, request) == 0
    counters = scheduler.manager.counters
    assert (counters.get("uncached.prompt_embeds"), counters.get("uncached.multimodal")) == (1, 1)
    assert counters.get("uncached.adapter") == 1
    # A field of vLLM's Request that Strata does not know, set: uncached; left empty: served.
    scheduler.unknown_fields = frozenset({"future_field"})
    new = Request(uuid.uuid4().hex, tokens)
    new.future_field = "changes the KV"  # type: ignore[attr-defined]
    assert answer_of(scheduler, new) == 0
    assert counters.get("uncached.field.future_field") == 1
    empty = Request(uuid.uuid4().hex, tokens)
    empty.future_field = None  # type: ignore[attr-defined]
    assert answer_of(scheduler, empty) == 2 * 32


def output_of(*steps: tuple[Request, list[int], int, int]) -> Any:
    """A SchedulerOutput stand-in: new requests (request, pages, computed tokens, scheduled tokens)."""
    return SimpleNamespace(
        total_num_scheduled_tokens=sum(s[3] for s in steps),
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r.request_id, block_ids=(pages,), num_computed_tokens=computed)
            for r, pages, computed, _ in steps
        ],
        num_scheduled_tokens={r.request_id: scheduled for r, _, _, scheduled in steps},
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
        ),
    )


def test_a_request_whose_step_fails_loses_its_own_saves_and_no_other_request_s_load(half, monkeypatch):
    scheduler, directory = half
    directory.release.set()
    hit = Request(uuid.uuid4().hex, prompt(3 * 32 + 5))
    stored(scheduler, hit, 3)
    assert answer_of(scheduler, hit) == 3 * 32
    scheduler.allocated(hit, 3 * 32)  # type: ignore[arg-type]
    cold = Request(uuid.uuid4().hex, [7 + i % 200 for i in range(4 * 32)], cache_salt="another tenant")
    assert answer_of(scheduler, cold) == 0
    real = scheduler._fingerprints

    def failing(tracked, blocks):  # a save that cannot be planned (a namespace gone, a bug)
        if tracked.request is cold:
            raise ValueError("namespace: no namespace named 'gone'")
        return real(tracked, blocks)

    monkeypatch.setattr(scheduler, "_fingerprints", failing)
    meta = scheduler.build(output_of((cold, list(range(8)), 0, 4 * 32), (hit, list(range(8, 15)), 3 * 32, 5)))
    assert [spec.request_id for spec in meta.loads] == [hit.request_id]
    load = meta.loads[0]
    assert (load.start, load.end, len(load.keys), load.refused) == (0, 3 * 32, 3, "")
    assert [save.request_id for save in meta.saves] == []
    assert scheduler.manager.counters.get("write_back.unplanned") == 1
    assert set(meta.prefills_done) == {hit.request_id, cold.request_id}


def test_a_load_that_cannot_be_planned_is_refused_never_dropped(half):
    scheduler, _ = half
    hit = Request(uuid.uuid4().hex, prompt(3 * 32 + 5))
    stored(scheduler, hit, 3)
    assert answer_of(scheduler, hit) == 3 * 32
    scheduler.allocated(hit, 3 * 32)  # type: ignore[arg-type]
    scheduler.requests[hit.request_id].plan.hits.pop()  # the plan lost a block it promised
    meta = scheduler.build(output_of((hit, list(range(7)), 3 * 32, 5)))
    (load,) = meta.loads
    assert load.refused.startswith("load not planned") and (load.start, load.end, load.pages) == (
        0,
        3 * 32,
        list(range(7)),
    )
    # A step that fails as a whole hands every promised load over, refused.
    again = Request(uuid.uuid4().hex, hit.prompt_token_ids)
    assert answer_of(scheduler, again) == 3 * 32
    scheduler.allocated(again, 3 * 32)  # type: ignore[arg-type]
    meta = scheduler.refused(output_of((again, list(range(20, 27)), 3 * 32, 5)), "the step could not be planned")
    (load,) = meta.loads
    assert (load.request_id, load.refused, load.start, load.end) == (
        again.request_id,
        "the step could not be planned",
        0,
        3 * 32,
    )


def running(request: Request, *, added: list[int] | None, computed: int, scheduled: int, resumed: Any = None) -> Any:
    """A SchedulerOutput stand-in of one running request. `resumed` None: vLLM 0.34's shape, which
    has no resumed_req_ids (it sends a resumed request among the new ones); a set: 0.32-0.33's."""
    cached = {
        "req_ids": [request.request_id],
        "new_block_ids": [(added,) if added is not None else None],
        "num_computed_tokens": [computed],
    }
    if resumed is not None:
        cached["resumed_req_ids"] = resumed
    return SimpleNamespace(
        total_num_scheduled_tokens=scheduled,
        scheduled_new_reqs=[],
        num_scheduled_tokens={request.request_id: scheduled},
        scheduled_cached_reqs=SimpleNamespace(**cached),
    )


def test_running_and_resumed_requests_in_each_supported_vllm_s_scheduler_output(half):
    scheduler, directory = half
    directory.release.set()
    request = Request(uuid.uuid4().hex, prompt(2 * 32 + 5))
    assert answer_of(scheduler, request) == 0
    scheduler.allocated(request, 0)  # type: ignore[arg-type]
    meta = scheduler.build(output_of((request, [0, 1, 2], 0, 2 * 32 + 5)))
    assert [(save.pages, len(save.blocks)) for save in meta.saves] == [([0, 1, 2], 2)]
    tracked = scheduler.requests[request.request_id]
    # Decoding, a page added: the same in every version (0.34 without resumed_req_ids).
    for page, shape in ((3, None), (4, set())):
        scheduler.build(running(request, added=[page], computed=2 * 32 + 5, scheduled=1, resumed=shape))
    assert tracked.pages == [0, 1, 2, 3, 4]
    # 0.32-0.33: resumed after a preemption among the running requests, with its pages anew.
    scheduler.build(running(request, added=[7, 8, 9], computed=0, scheduled=2 * 32 + 5, resumed={request.request_id}))
    assert tracked.pages == [7, 8, 9]
    # 0.34: resumed among the new requests, with its whole page table.
    scheduler.build(output_of((request, [4, 5, 6], 0, 2 * 32 + 5)))
    assert tracked.pages == [4, 5, 6]
    assert scheduler.manager.counters.get("write_back.unplanned") == 0


def test_the_vllm_versions_the_connector_supports_are_checked_at_start():
    from worker.dataplane.connectors.vllm.runtime import check_vllm_version

    for version in ("0.32.0", "0.32.0+cpu", "0.33.1", "0.34.0rc1.dev12+g1234abc"):
        check_vllm_version(version)
    for version in ("0.31.2", "0.35.0", "1.0.0"):
        with pytest.raises(ValueError, match=rf"supports vLLM 0\.32 to 0\.34; this is vLLM {re.escape(version)}"):
            check_vllm_version(version)
    with pytest.raises(ValueError, match="cannot read vLLM's version 'unknown'"):
        check_vllm_version("unknown")


def test_a_shared_namespace_leads_the_prompt_and_the_saves_chain_on_from_it(half):
    scheduler, directory = half
    directory.release.set()
    directory.shared = {"library": b"library"}
    tokens = prompt(3 * 32 + 5)
    stored(scheduler, Request("lib", tokens), 2, namespace="library")  # the library holds two blocks
    request = Request(
        uuid.uuid4().hex,
        tokens,
        kv_transfer_params={NAMESPACE_PARAM: "tenant-a", TAG_PARAM: namespace_tag(SECRET, "tenant-a")},
    )
    assert answer_of(scheduler, request) == 2 * 32
    tracked = scheduler.requests[request.request_id]
    library = scheduler.manager.fingerprinter("library").blocks(tokens)
    own = scheduler.manager.fingerprinter("tenant-a").blocks(tokens[64:], parent=library[1].prefix_key)
    assert [fp.prefix_key for fp in tracked.fingerprints] == [fp.prefix_key for fp in library[:2] + own]
    assert [fp.index for fp in tracked.fingerprints] == [0, 1, 2]
    assert scheduler.manager.counters.get("lookup.shared_hits") == 2
    # Without the share, the same prompt of another tenant finds nothing.
    directory.shared = {}
    assert answer_of(scheduler, Request(uuid.uuid4().hex, tokens)) == 0
    # A salted request keys its own chain only: a shared namespace's blocks are unsalted.
    directory.shared = {"library": b"library"}
    assert answer_of(scheduler, Request(uuid.uuid4().hex, tokens, cache_salt="s")) == 0


def test_every_field_of_vllm_s_request_is_known():
    """Each field of the installed vLLM's Request is keyed, makes a request uncached, or does not
    change the KV: a new one (a newer vLLM) makes the requests that set it uncached until it is."""
    from vllm.v1.request import Request as VllmRequest

    from worker.dataplane.connectors.vllm.requests import request_fields, unknown_fields

    assert "cache_salt" in request_fields(VllmRequest)
    assert unknown_fields(VllmRequest) == []


@pytest.fixture
def async_half(tmp_path: Path, shm_name: str):
    """A scheduler half whose host hits load outside the engine step (async_load_tiers host)."""
    scheduler, directory, store = make_half(tmp_path, shm_name, async_load_tiers="host")
    directory.release.set()
    yield scheduler
    scheduler.close()
    store.close()


def test_a_hit_in_an_asynchronous_tier_is_handed_over_in_the_next_step_and_never_loaded_twice(async_half):
    scheduler = async_half
    hit = Request(uuid.uuid4().hex, prompt(3 * 32 + 5))
    stored(scheduler, hit, 2)
    assert answer_of(scheduler, hit) == 2 * 32 and scheduler.asynchronous(hit)
    scheduler.allocated(hit, 2 * 32, [9, 8, 7, 6, 5, 4, 3])  # type: ignore[arg-type]
    # The next step hands the load over although the request is not scheduled in it (it waits).
    (load,) = scheduler.build(output_of()).loads
    assert (load.asynchronous, load.start, load.end, load.pages, load.refused) == (
        True,
        0,
        2 * 32,
        [9, 8, 7, 6, 5, 4, 3],
        "",
    )
    # Loaded, it is scheduled with its tokens computed: nothing is loaded again, the rest is saved.
    meta = scheduler.build(output_of((hit, [9, 8, 7, 6, 5, 4, 3], 2 * 32, 32 + 5)))
    assert meta.loads == []
    assert [[index for index, _, _ in save.blocks] for save in meta.saves] == [[2]]


def test_a_step_that_fails_as_a_whole_still_ends_the_asynchronous_loads_it_owed(async_half):
    scheduler = async_half
    hit = Request(uuid.uuid4().hex, prompt(2 * 32 + 5))
    stored(scheduler, hit, 2)
    assert answer_of(scheduler, hit) == 2 * 32
    scheduler.allocated(hit, 2 * 32, [1, 2, 3, 4, 5])  # type: ignore[arg-type]
    (load,) = scheduler.refused(output_of(), "the step could not be planned").loads
    assert (load.asynchronous, load.refused, load.pages) == (True, "the step could not be planned", [1, 2, 3, 4, 5])
    assert scheduler.build(output_of()).loads == []


def test_a_hit_in_no_asynchronous_tier_loads_inside_the_step(half):
    scheduler, _ = half
    hit = Request(uuid.uuid4().hex, prompt(2 * 32 + 5))
    stored(scheduler, hit, 2)
    assert answer_of(scheduler, hit) == 2 * 32 and not scheduler.asynchronous(hit)  # host: not asynchronous by default


def test_a_request_whose_load_failed_is_offered_nothing_more(async_half):
    """vLLM asks again for a request whose asynchronous load failed (its pages freed): offering the
    same hit would fail the same way, for ever."""
    from worker.dataplane.connectors.vllm.metadata import LoadReport, StrataWorkerMeta

    scheduler = async_half
    hit = Request(uuid.uuid4().hex, prompt(2 * 32 + 5))
    stored(scheduler, hit, 2)
    assert answer_of(scheduler, hit) == 2 * 32
    scheduler.allocated(hit, 2 * 32, [1, 2, 3, 4, 5])  # type: ignore[arg-type]
    scheduler.build(output_of())
    failed = LoadReport([], [], 0.1, [], {"host": 2}, failure="layer 0: block 1 could not be loaded")
    scheduler.update(SimpleNamespace(kv_connector_worker_meta=StrataWorkerMeta(loads={hit.request_id: failed})))
    assert scheduler.matched_tokens(hit, 0) == 0 and not scheduler.asynchronous(hit)


def test_the_pages_a_synchronous_load_fills_leave_vllm_s_prefix_cache_at_once(half):
    """vLLM caches a synchronous load's pages as it allocates them, before the load has run: they
    leave its prefix cache at once (so no request scheduled meanwhile is handed them as a local
    hit), from the first page the load fills to the request's last; vLLM's own hit stays."""
    scheduler, _ = half
    cache = scheduler.loaded_pages.kv_cache_manager
    hit = Request(uuid.uuid4().hex, prompt(3 * 32 + 5))
    stored(scheduler, hit, 3)
    for _ in range(200):  # vLLM's own cache held the first page (16 tokens)
        answer = scheduler.matched_tokens(hit, 16)
        if answer is not None:
            break
        threading.Event().wait(0.01)
    assert answer == 3 * 32 - 16 and not scheduler.asynchronous(hit)
    table = [40, 41, 42, 43, 44, 45, 46, 47]
    scheduler.allocated(hit, answer, table)  # type: ignore[arg-type]
    assert cache.evicted == [set(table[1:])]


def test_a_load_reported_whole_puts_its_pages_back_and_a_failed_one_never(half):
    """Once the worker reports a synchronous load whole, its pages (full ones, as far as the
    request has computed) go back into vLLM's prefix cache; a failed load's pages never do, nor
    those of a request that no longer runs on the same pages."""
    from vllm.v1.request import RequestStatus

    from worker.dataplane.connectors.vllm.metadata import LoadReport, StrataWorkerMeta

    scheduler, _ = half
    cache = scheduler.loaded_pages.kv_cache_manager
    outcomes = {}
    for label, failure, moved in (
        ("whole", "", False),
        ("failed", "block 1: checksum mismatch", False),
        ("moved", "", True),
    ):
        hit = Request(uuid.uuid4().hex, prompt(3 * 32 + 5), status=RequestStatus.RUNNING)
        stored(scheduler, hit, 3)
        assert answer_of(scheduler, hit) == 3 * 32
        table = [10, 11, 12, 13, 14, 15, 16]
        cache.tables[hit.request_id] = [99, *table[1:]] if moved else table
        scheduler.allocated(hit, 3 * 32, table)  # type: ignore[arg-type]
        hit.num_computed_tokens = 3 * 32 + 5  # the step computed the rest of the prompt
        report = LoadReport([], [], 0.1, [], {"host": 3}, failure=failure)
        before = len(cache.cached)
        scheduler.update(SimpleNamespace(kv_connector_worker_meta=StrataWorkerMeta(loads={hit.request_id: report})))
        outcomes[label] = cache.cached[before:]
    assert [(first, end) for _, first, end in outcomes["whole"]] == [(0, 6)]  # 101 tokens: 6 full pages
    assert outcomes["failed"] == [] and outcomes["moved"] == []


def test_an_asynchronous_load_s_pages_stay_with_vllm_which_caches_them_once_loaded(async_half):
    scheduler = async_half
    hit = Request(uuid.uuid4().hex, prompt(2 * 32 + 5))
    stored(scheduler, hit, 2)
    assert answer_of(scheduler, hit) == 2 * 32 and scheduler.asynchronous(hit)
    scheduler.allocated(hit, 2 * 32, [1, 2, 3, 4, 5])  # type: ignore[arg-type]
    assert scheduler.loaded_pages.kv_cache_manager.evicted == []


def test_until_vllm_binds_its_cache_manager_every_load_runs_outside_the_step(tmp_path: Path, shm_name: str):
    scheduler, directory, store = make_half(tmp_path, shm_name)
    try:
        directory.release.set()
        scheduler.loaded_pages = None
        hit = Request(uuid.uuid4().hex, prompt(2 * 32 + 5))
        stored(scheduler, hit, 2)
        assert answer_of(scheduler, hit) == 2 * 32 and scheduler.asynchronous(hit)
    finally:
        scheduler.close()
        store.close()


def test_each_step_is_numbered_with_the_last_report_its_plan_had_read(half):
    from worker.dataplane.connectors.vllm.metadata import StrataWorkerMeta

    scheduler, _ = half
    first, second = scheduler.build(output_of()), scheduler.build(output_of())
    assert (first.step, first.reported, second.step, second.reported) == (1, 0, 2, 0)
    scheduler.update(SimpleNamespace(kv_connector_worker_meta=StrataWorkerMeta(step=1)))
    third = scheduler.refused(output_of(), "the step could not be planned")
    assert (third.step, third.reported) == (3, 1)
    scheduler.update(SimpleNamespace(kv_connector_worker_meta=StrataWorkerMeta(step=3)))
    scheduler.update(SimpleNamespace(kv_connector_worker_meta=StrataWorkerMeta(step=2)))  # late: changes nothing
    assert scheduler.build(output_of()).reported == 3


def test_a_request_that_ends_while_its_load_runs_is_named_to_the_worker(async_half):
    """vLLM frees the pages of a request that ended while its asynchronous load runs only once the
    worker reports that load finished: the next step names it, and the worker gives it up."""
    scheduler = async_half
    hit = Request(uuid.uuid4().hex, prompt(2 * 32 + 5))
    stored(scheduler, hit, 2)
    assert answer_of(scheduler, hit) == 2 * 32
    scheduler.allocated(hit, 2 * 32, [1, 2, 3, 4, 5])  # type: ignore[arg-type]
    assert [load.request_id for load in scheduler.build(output_of()).loads] == [hit.request_id]
    hit.finished = True
    scheduler.finished(hit)  # type: ignore[arg-type]
    assert scheduler.build(output_of()).aborted == [hit.request_id]
    assert scheduler.build(output_of()).aborted == []


def test_a_request_that_ended_before_its_load_was_handed_over_is_refused_not_read(async_half):
    scheduler = async_half
    hit = Request(uuid.uuid4().hex, prompt(2 * 32 + 5))
    stored(scheduler, hit, 2)
    assert answer_of(scheduler, hit) == 2 * 32
    scheduler.allocated(hit, 2 * 32, [1, 2, 3, 4, 5])  # type: ignore[arg-type]
    hit.finished = True
    scheduler.finished(hit)  # type: ignore[arg-type]
    (load,) = scheduler.build(output_of()).loads
    assert (load.asynchronous, load.refused, load.pages) == (
        True,
        "the request ended before its load started",
        [1, 2, 3, 4, 5],
    )
