"""vLLM with Strata answers as vLLM alone does when loads fail, and stores nothing a failed load touched:
requests whose loads fail by each cause (their last block evicted between the lookup and the load,
a byte of it flipped in its tier, its tier answering past the load's deadline, an error in the
worker half part-way through the scatter), on the synchronous tier (host: inside the engine step)
and the asynchronous one (disk: beside it, given up at its deadline), each completing new blocks
in the step its load fails, in one round with clean hits and cold prompts. Every answer is
compared with vLLM alone's (tests/connectors/differential.py: top-5 logprobs at every position,
within vLLM's own noise); then vLLM's prefix cache is flushed and every prompt asked again, so that
what Strata stored is what is served, and compared too. vLLM alone is asked the same prompts in the
same order without a flush, so it computes the same spans as vLLM with Strata does.

Three scripted scenes follow: a request whose synchronous load fails is aborted right after that
step, and another with its prefix arrives (were the failed pages left in vLLM's prefix cache, it
would be handed them); a prompt loaded whole, then its next turn, which hits the loaded pages in
vLLM's prefix cache (they went back into it once the load was known whole); and two servers of
one checkpoint on one host pool, one running it with a RoPE theta override: nothing is shared
across them, and with the same flags everything is.

Each fix is then turned off in turn (tests/connectors/faults.py) and the part of the test it
guards must fail: poisoned saves kept, loaded pages shared through vLLM's prefix cache, the model
key taken from the checkpoint alone. The engines run in this process (VLLM_ENABLE_V1_MULTIPROCESSING
off), so that the scripted scenes abort a request between two engine steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import shutil
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.connectors.conftest import environment
from tests.connectors.differential import (
    Answer,
    Ask,
    Reference,
    answer_of,
    compare,
    deviation,
    run_round,
    sampling,
    tolerance,
)
from tests.connectors.faults import CAUSES, FAULT_PARAM
from tests.support import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "blend-multihop"
BLOCK = 64
"""Strata's block in these engines: a 259-token question is 4 blocks and 3 tokens."""
PAGES = 512
"""vLLM's KV space: 512 pages of 32 tokens, every prompt of the test at once (nothing preempted)."""
ROPE_THETA = {"rope_parameters": {"rope_theta": 20000.0, "rope_type": "default"}}
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def questions(count: int, seed: int) -> list[tuple[int, ...]]:
    """Multi-hop questions of the blend fixture (259 tokens: 8 passages, QUERY, a binding)."""
    from benchmarks.models.multihop import MAX_CORPUS, MAX_PASSAGES, draw_question, make_corpus

    rng = random.Random(seed)
    corpus = make_corpus(MAX_CORPUS, rng=rng)
    return [tuple(draw_question(rng, corpus, MAX_PASSAGES).prompt) for _ in range(count)]


P = questions(13, seed=2027)
"""The stored prompts: P0-P3 moved to disk, P4-P12 in host."""
X = [question[:125] for question in questions(13, seed=2028)]
"""What follows each stored prompt: 384 tokens in all, so blocks 4 and 5 complete in the step whose
load fails."""
Y = questions(2, seed=2029)
COLD = questions(2, seed=2030)


def ask(prompt: tuple[int, ...], label: str, fault: str = "") -> Ask:
    return Ask(prompt=prompt, label=label, params=((FAULT_PARAM, fault),) if fault else ())


STORE_DISK = [ask(P[i], f"P{i}") for i in range(4)]
STORE_HOST = [ask(P[i], f"P{i}") for i in range(4, 13)]
FAILING = [ask(P[i] + X[i], f"P{i}+X, {cause} (disk)", cause) for i, cause in enumerate(CAUSES)] + [
    ask(P[4 + i] + X[4 + i], f"P{4 + i}+X, {cause} (host)", cause) for i, cause in enumerate(CAUSES)
]
FAULTS = [
    ask(COLD[0], "cold 0"),
    *(a for a in FAILING if a.params[0][1] != "deadline"),
    ask(P[8] + X[8], "P8+X (clean hit)"),
]
"""A round: a cold prompt first (its prefill shares the steps), the failing loads, a clean hit."""
DEADLINES = [
    ask(COLD[1], "cold 1"),
    *(a for a in FAILING if a.params[0][1] == "deadline"),
    ask(P[9] + X[9], "P9+X (clean hit)"),
]
"""The loads past their deadline, in a round of their own: a synchronous load that waits for its
tier holds back the step's other synchronous loads, which then miss their deadline too."""
AGAIN = [dataclasses.replace(a, params=(), label=f"{a.label}, asked again") for a in FAULTS + DEADLINES]
ROUNDS = {
    "store-disk": STORE_DISK,
    "store-host": STORE_HOST,
    "faults": FAULTS,
    "deadlines": DEADLINES,
    "again": AGAIN,
}
FLUSHED = {"faults", "deadlines", "again"}
"""The rounds before which vLLM with Strata's prefix cache is flushed: what it serves, it loads."""


# -- the node and its engines --------------------------------------------------------------------------
@dataclasses.dataclass
class Node:
    name: str
    work: Path
    extra: dict[str, Any]

    def transfer(self, connector: str) -> Any:
        from vllm.config import KVTransferConfig

        return KVTransferConfig(
            kv_connector=connector,
            kv_connector_module_path="tests.connectors.faults",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={**self.extra, "status_port": free_port()},
        )

    def store(self, profile: Any) -> Any:
        from worker.dataplane.connectors.vllm.runtime import node_options
        from worker.dataplane.store import build_store

        return build_store(node_options(self.extra), profile=profile, environ={})


@contextlib.contextmanager
def node() -> Iterator[Node]:
    name = f"faults-{uuid.uuid4().hex[:6]}"
    work = Path(tempfile.mkdtemp(prefix="strata-faults-"))
    extra = {
        "node_name": name,
        "tiers": "host,disk",
        "block_tokens": BLOCK,
        "host_pool_name": f"strata-test-{name}",
        "host_bytes": "64MiB",
        "disk_path": str(work / "disk"),
        "disk_bytes": "128MiB",
        "load_deadline_seconds": 1.5,
        # STRATA_TEST_BLEND=1: the same test with fragment reuse on (its prompts share prefixes only).
        "blend": os.environ.get("STRATA_TEST_BLEND") == "1",
    }
    try:
        yield Node(name=name, work=work, extra=extra)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for pool in Path("/dev/shm").glob(f"strata-test-{name}*"):
            pool.unlink(missing_ok=True)


def engine(checkpoint: Path, transfer: Any = None, *, overrides: dict[str, Any] | None = None) -> Any:
    """An engine in this process (its steps driven by this thread)."""
    from vllm import LLM

    with environment(IN_PROCESS):
        return LLM(
            model=str(checkpoint),
            dtype="float32",
            skip_tokenizer_init=True,
            max_model_len=1024,
            block_size=32,
            num_gpu_blocks_override=PAGES,
            max_num_batched_tokens=2048,
            kv_transfer_config=transfer,
            hf_overrides=overrides or {},
            seed=0,
        )


@contextlib.contextmanager
def running(checkpoint: Path, transfer: Any = None, **options: Any) -> Iterator[Any]:
    llm = engine(checkpoint, transfer, **options)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


def profile_of(checkpoint: Path) -> Any:
    from worker.dataplane.models.loading import checkpoint_profile

    return checkpoint_profile(checkpoint, dtype="float32", block_tokens=BLOCK)


def settled(store: Any) -> int:
    """The blocks of the node's tiers, once the engine's save queue has stored what it holds (the
    count holds still for a second)."""
    count, deadline = -1, time.monotonic() + 30
    while time.monotonic() < deadline:
        now = sum(len(store.tier(name).keys()) for name in store.names)
        if now == count:
            return now
        count = now
        time.sleep(1.0)
    raise AssertionError("the node's saves did not settle within 30 s")


def settle(node: Node, profile: Any) -> int:
    store = node.store(profile)
    try:
        return settled(store)
    finally:
        store.close()


def host_to_disk(node: Node, profile: Any) -> int:
    """Every block of the host tier moved to the disk tier (copied, then dropped from host)."""
    store = node.store(profile)
    try:
        settled(store)
        keys = store.tier("host").keys()
        for key in keys:
            store.copy(key, source="host", target="disk")
            store.delete(key, tier="host")
        return len(keys)
    finally:
        store.close()


def counted(llm: Any, name: str) -> float:
    """A counter of the engine's connector (its status port's /metrics), summed over its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    port = llm.llm_engine.vllm_config.kv_transfer_config.kv_connector_extra_config["status_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == f"{name}_total"
    )


def load_failures(llm: Any) -> float:
    """The loads the engine's connector counted failed."""
    return counted(llm, "strata_load_failures")


# -- the scripted scenes -------------------------------------------------------------------------------
def aborted_then_shared(llm: Any) -> Answer:
    """A request whose load of P10 fails is aborted right after that step; another request with
    P10's prefix arrives then. Its answer."""
    engine = llm.llm_engine
    failing = ask(P[10] + X[10], "P10+X, corrupt (host), aborted after its step", "corrupt")
    engine.add_request("aborted", {"prompt_token_ids": list(failing.prompt)}, sampling(failing))
    engine.step()
    engine.abort_request(["aborted"])
    after = ask(P[10] + Y[0][:96], "P10+Y, after the abort")
    engine.add_request("after", {"prompt_token_ids": list(after.prompt)}, sampling(after))
    done: dict[str, Any] = {}
    for _ in range(200):
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
        if not engine.has_unfinished_requests():
            break
    assert set(done) == {"after"}, f"finished: {sorted(done)}"
    return answer_of(done["after"])


OVERRIDDEN = [ask(P[11], "P11 (theta 20000)"), ask(P[12] + X[12], "P12+X (theta 20000)")]
LOADED = ask(P[8] + X[8], "P8+X, loaded whole")
NEXT_TURN = ask(P[8] + X[8] + Y[1][:64], "P8+X+Y, its next turn")
"""A prompt loaded whole from the host tier (12 pages), then the next turn of its conversation: the
loaded pages are back in vLLM's prefix cache by then, and it hits them there."""


# -- fixtures ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("faults") / "multihop"
    shutil.copytree(FIXTURE, path)
    return path


@dataclasses.dataclass
class Expected:
    """vLLM alone's answers to the rounds and scenes, and the tolerance measured from it."""

    rounds: dict[str, list[Answer]]
    after_abort: Answer
    overridden: list[Answer]
    plain_p11: Answer
    next_turn: Answer
    noise: float

    @property
    def tolerance(self) -> float:
        return tolerance(self.noise)


@pytest.fixture(scope="module")
def expected(checkpoint) -> Expected:
    with running(checkpoint) as plain:
        reference = Reference(plain, {})
        rounds = {name: reference.of(name, asks) for name, asks in ROUNDS.items()}
        after_abort = aborted_then_shared(plain)
        plain_p11 = run_round(plain, OVERRIDDEN[:1], {})[0]
        assert plain.reset_prefix_cache()
        next_turn = [run_round(plain, [turn], {})[0] for turn in (LOADED, NEXT_TURN)][1]
        reference.measure({name: ROUNDS[name] for name in FLUSHED})
        noise = reference.noise
        again = aborted_then_shared(plain)
        noise = max(noise, deviation(after_abort, again))
    with running(checkpoint, overrides=ROPE_THETA) as overridden_engine:
        overridden = Reference(overridden_engine, {})
        answers = overridden.of("overridden", OVERRIDDEN)
        overridden.measure({"overridden": OVERRIDDEN})
        noise = max(noise, overridden.noise)
    return Expected(rounds, after_abort, answers, plain_p11, next_turn, noise)


# -- serving the test's parts --------------------------------------------------------------------------
def serve_rounds(llm: Any, node: Node, profile: Any, expected: Expected) -> list[str]:
    """Serve the rounds in order: P0-P3 stored and moved to disk, P4-P12 stored in host, then the
    failing round and the round asked again, each on a flushed prefix cache. Every problem."""
    problems: list[str] = []
    for name, asks in ROUNDS.items():
        if name == "store-host":
            assert host_to_disk(node, profile) == 4 * len(STORE_DISK)
        if name in FLUSHED:
            settle(node, profile)
            assert llm.reset_prefix_cache()
        got = run_round(llm, asks, {})
        problems += [f"[{name}] {p}" for p in compare(asks, expected.rounds[name], got, expected.tolerance)]
    return problems


def serve_abort_scene(llm: Any, expected: Expected) -> list[str]:
    assert llm.reset_prefix_cache()
    before = load_failures(llm)
    got = aborted_then_shared(llm)
    assert load_failures(llm) > before, "the aborted request's load was meant to fail"
    problem = compare([ask(P[10], "P10+Y, after the abort")], [expected.after_abort], [got], expected.tolerance)
    return [f"[abort] {p}" for p in problem]


def serve_next_turn_scene(llm: Any, expected: Expected) -> list[str]:
    """A prompt loaded whole from the host tier, then its next turn: served from vLLM's prefix
    cache (the loaded pages went back into it once the load was reported whole), not loaded again."""
    assert llm.reset_prefix_cache()
    loaded = run_round(llm, [LOADED], {})[0]
    hits = counted(llm, "strata_hit_tokens")
    got = run_round(llm, [NEXT_TURN], {})[0]
    problems = [f"[next turn] {p}" for p in compare([NEXT_TURN], [expected.next_turn], [got], expected.tolerance)]
    if not loaded.cached:
        problems.append(f"[next turn] {LOADED.label}: nothing loaded (cached {loaded.cached})")
    again = counted(llm, "strata_hit_tokens") - hits
    if got.cached < len(LOADED.prompt) or again:
        problems.append(
            f"[next turn] {got.cached} tokens cached, {again:.0f} of them loaded again: the loaded pages "
            "were meant to be hit in vLLM's prefix cache"
        )
    return problems


def serve_override_scene(checkpoint: Path, node: Node, expected: Expected, connector: str) -> list[str]:
    """P11 and P12 stored by a server of the checkpoint as it is, then asked of one with a RoPE theta
    override (nothing of the first may be served to it), then of another with the same override
    (everything of the second is)."""
    problems: list[str] = []
    with running(checkpoint, node.transfer(connector)) as first:
        run_round(first, [ask(P[11], "P11"), ask(P[12] + X[12], "P12+X")], {})
    for label, must_hit in (("theta 20000, after the plain server", False), ("theta 20000 again", True)):
        with running(checkpoint, node.transfer(connector), overrides=ROPE_THETA) as overridden:
            got = run_round(overridden, OVERRIDDEN, {})
            problems += [f"[{label}] {p}" for p in compare(OVERRIDDEN, expected.overridden, got, expected.tolerance)]
        cached = [answer.cached for answer in got]
        if must_hit and not all(cached):
            problems.append(f"[{label}] cached tokens {cached}: the same flags were meant to share every block")
        if not must_hit and any(cached):
            problems.append(f"[{label}] cached tokens {cached}: another server's blocks were served")
    return problems


# -- the tests -----------------------------------------------------------------------------------------
def test_the_override_and_the_context_change_the_answers(expected):
    """What the comparisons rest on: the RoPE override changes the KV and so the answers' logprobs,
    far beyond the tolerance; vLLM alone answers within its own noise."""
    assert deviation(expected.plain_p11, expected.overridden[0]) > 100 * expected.tolerance
    assert expected.noise < 1e-3, f"vLLM alone strays {expected.noise} from itself"


def test_loads_that_fail_answer_as_vllm_alone_and_store_nothing_they_poisoned(checkpoint, expected, record_property):
    profile = profile_of(checkpoint)
    with node() as fresh, running(checkpoint, fresh.transfer("FaultyLoads")) as llm:
        problems = serve_rounds(llm, fresh, profile, expected)
        failures = load_failures(llm)
        problems += serve_abort_scene(llm, expected)
        problems += serve_next_turn_scene(llm, expected)
    record_property("load_failures", failures)
    assert not problems, "vLLM with Strata differs from vLLM alone:\n" + "\n".join(problems)
    assert failures >= len(FAILING), f"{failures} loads failed, {len(FAILING)} were made to fail"


def test_two_servers_share_blocks_only_with_the_same_runtime_model(checkpoint, expected):
    with node() as fresh:
        problems = serve_override_scene(checkpoint, fresh, expected, "FaultyLoads")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("mutant", "part", "expected_problem"),
    [
        ("PoisonedSavesKept", "rounds", "(host), asked again"),
        ("LoadedPagesShared", "abort", "[abort] P10+Y"),
        ("CheckpointKeyOnly", "override", "[theta 20000, after the plain server]"),
    ],
)
def test_the_comparison_fails_with_a_fix_turned_off(
    checkpoint, expected, mutant, part, expected_problem, record_property
):
    profile = profile_of(checkpoint)
    with node() as fresh:
        if part == "override":
            problems = serve_override_scene(checkpoint, fresh, expected, mutant)
        else:
            with running(checkpoint, fresh.transfer(mutant)) as llm:
                if part == "rounds":
                    problems = serve_rounds(llm, fresh, profile, expected)
                else:
                    run_round(llm, STORE_HOST, {})
                    settle(fresh, profile)
                    problems = serve_abort_scene(llm, expected)
    record_property("problems", problems[:5])
    assert any(expected_problem in problem for problem in problems), f"{mutant} went unseen: {problems}"
