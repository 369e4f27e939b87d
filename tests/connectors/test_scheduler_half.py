"""The connector's scheduler half with a real host tier and stand-ins for vLLM's request objects and
the directory: a lookup that needs a round trip answers "ask again" until it is back, an outage of
the directory is a miss (counted), vLLM's own cache goes first, and a bad namespace is served
uncached."""

from __future__ import annotations

import dataclasses
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from worker.dataplane.config import load_config
from worker.dataplane.connectors.vllm.runtime import Runtime
from worker.dataplane.connectors.vllm.scheduler_half import SchedulerHalf
from worker.dataplane.directory import DirectoryUnavailable, LookupResult
from worker.dataplane.layout import ModelProfile, block_layout
from worker.dataplane.offload import OffloadManager
from worker.dataplane.store import build_store

PROFILE = ModelProfile(model_id="sched", layers=2, kv_heads=2, head_dim=8, dtype="float32", block_tokens=32)


@dataclasses.dataclass
class Request:
    """What the scheduler half reads of vLLM's Request."""

    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    arrival_time: float = 0.0
    mm_features: list[Any] = dataclasses.field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    num_output_tokens = 0

    def get_finished_reason(self) -> str:
        return "length"


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


@pytest.fixture
def half(tmp_path: Path, shm_name: str):
    config = load_config(
        overrides={
            "node_name": "sched",
            "tiers": "host,remote",
            "host_pool_name": shm_name,
            "host_bytes": "1MiB",
            "remote_url": str(tmp_path / "l3"),
            "status_port": 1,
        },
        environ={},
    )
    store = build_store(config, profile=PROFILE, environ={})
    directory = Directory()
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
    yield scheduler, directory
    scheduler.close()
    store.close()


def stored(half: SchedulerHalf, request: Request, blocks: int) -> None:
    """Put the request's first `blocks` blocks in the host tier."""
    keys = half.manager.fingerprinter(request.cache_salt or "default").prefix_keys(request.prompt_token_ids)
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
    request = Request(uuid.uuid4().hex, prompt(2 * 32 + 1), cache_salt="tenant-new")
    answer = scheduler.matched_tokens(request, 0)
    for _ in range(100):
        if answer is not None:
            break
        threading.Event().wait(0.01)
        answer = scheduler.matched_tokens(request, 0)
    assert answer == 0
    assert scheduler.manager.counters.get("lookup_failures") == 1


@pytest.mark.parametrize("salt,params", [("not a namespace!", None), (None, {"strata_namespace": "x" * 64})])
def test_a_name_that_is_no_namespace_is_served_uncached(half, salt, params):
    scheduler, _ = half
    request = Request(uuid.uuid4().hex, prompt(64), cache_salt=salt, kv_transfer_params=params)
    assert scheduler.matched_tokens(request, 0) == 0
    assert scheduler.manager.counters.get("lookup_failures") == 1
    scheduler.finished(request)  # type: ignore[arg-type]
    assert scheduler.requests == {}


def test_a_shared_namespace_leads_the_prompt_and_the_saves_chain_on_from_it(half):
    scheduler, directory = half
    directory.release.set()
    directory.shared = {"library": b"library"}
    tokens = prompt(3 * 32 + 5)
    stored(scheduler, Request("lib", tokens, cache_salt="library"), 2)  # the library holds two blocks
    request = Request(uuid.uuid4().hex, tokens, cache_salt="tenant-a")
    assert answer_of(scheduler, request) == 2 * 32
    tracked = scheduler.requests[request.request_id]
    library = scheduler.manager.fingerprinter("library").blocks(tokens)
    own = scheduler.manager.fingerprinter("tenant-a").blocks(tokens[64:], parent=library[1].prefix_key)
    assert [fp.prefix_key for fp in tracked.fingerprints] == [fp.prefix_key for fp in library[:2] + own]
    assert [fp.index for fp in tracked.fingerprints] == [0, 1, 2]
    assert scheduler.manager.counters.get("lookup.shared_hits") == 2
    # Without the share, the same prompt of another tenant finds nothing.
    directory.shared = {}
    assert answer_of(scheduler, Request(uuid.uuid4().hex, tokens, cache_salt="tenant-b")) == 0
