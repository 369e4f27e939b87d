"""vLLM with Strata at tensor parallel 2 answers as vLLM alone at tensor parallel 2 (the
differential protocol of test_differential, on its checkpoint: four kv heads, two per rank), with
hits from host, disk and remote; a block whose copy fails on one rank only is recomputed by every
rank; and the blocks written at two ranks serve a one-rank server of the same model, which answers
as vLLM alone at one rank. With the ranks' heads mixed up (ShardingOff) the comparison fails.

vLLM's CPU backend runs two ranks here with one core each (VLLM_CPU_OMP_THREADS_BIND="0|1").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.connectors.conftest import environment
from tests.connectors.differential import Ask, Sharing, run_round
from tests.connectors.mutants import FAIL_KEYS
from tests.connectors.test_differential import (
    BLOCK,
    PAGES,
    S1,
    P,
    Reference,
    StrataNode,
    ask,
    checkpoints,  # noqa: F401 - the module's fixture
    flood,
    hit_blocks,
    move_all,
    profile_of,
    registered,
    remote,  # noqa: F401 - the module's fixture
    serve,
    shutdown,
    strata_node,
)
from tests.support import node_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TWO_RANKS = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}

STORE = [ask(0, "p0"), ask(1, "p1"), ask(2, "p2 salt-1", salt=S1), ask(3, "p3")]


def again(*others: Ask) -> list[Ask]:
    return list(others) + [dataclasses.replace(stored, label=f"{stored.label} again") for stored in STORE]


ROUNDS: dict[str, list[Ask]] = {
    "store": STORE,
    "flood-1": flood(1),
    "host": again(ask(5, "p5 cold")),
    "flood-2": flood(2),
    "disk": again(ask(6, "p6 cold")),
    "flood-3": flood(3),
    "remote": again(ask(7, "p7 cold")),
}
"""Served at two ranks; between host, disk and remote the stored blocks move down a tier."""

ONE_RANK = {"one rank": again(ask(5, "p5 (written at two ranks)"), ask(7, "p7 (written at two ranks)"))}
"""Served at one rank after ROUNDS: every block it hits was written at two ranks."""

FAILING = (1, 1)
"""(prompt, block): the block whose copy fails on the second rank only."""


def engine(checkpoint: Path, env: dict[str, str], ranks: int, transfer: Any = None, *, stages: int = 1) -> Any:
    """vLLM at `ranks` tensor-parallel ranks in each of `stages` pipeline stages."""
    from vllm import LLM

    with environment({**env, **(TWO_RANKS if ranks * stages == 2 else {})}):
        return LLM(
            model=str(checkpoint),
            dtype="float32",
            skip_tokenizer_init=True,
            max_model_len=1024,
            block_size=32,
            num_gpu_blocks_override=PAGES,
            max_num_batched_tokens=512,
            tensor_parallel_size=ranks,
            pipeline_parallel_size=stages,
            kv_transfer_config=transfer,
            disable_log_stats=False,
            seed=0,
        )


def measured_reference(
    checkpoint: Path, env: dict[str, str], ranks: int, rounds: dict[str, list[Ask]], *, stages: int = 1
) -> Reference:
    """vLLM alone's answers at `ranks` ranks (in each of `stages` stages) and its noise (its engine
    closed once measured)."""
    llm = engine(checkpoint, env, ranks, stages=stages)
    try:
        reference = Reference(llm, {})
        reference.measure(rounds)
    finally:
        shutdown(llm)
    return reference


@pytest.fixture(scope="module")
def reference_two(checkpoints, vllm_environment) -> Reference:  # noqa: F811 - the imported fixture
    return measured_reference(checkpoints.x, vllm_environment, 2, ROUNDS)


@pytest.fixture(scope="module")
def reference_one(checkpoints, vllm_environment) -> Reference:  # noqa: F811
    return measured_reference(checkpoints.x, vllm_environment, 1, ONE_RANK)


@pytest.fixture
def node(remote) -> Iterator[StrataNode]:  # noqa: F811 - the imported fixture
    with strata_node(remote) as opened:
        yield opened


def failing_key(profile: Any) -> str:
    from controlplane.directory.services import namespace_ensure
    from worker.dataplane.hashing import Fingerprinter

    salt = namespace_ensure(name="default").salt_bytes
    prompt, block = FAILING
    return str(Fingerprinter.for_profile(profile, ns_salt=salt).prefix_keys(P[prompt])[block])


def between(node: StrataNode, profile: Any):  # noqa: ANN201
    def move(name: str) -> None:
        if name == "host":
            registered(node, profile)
        elif name == "flood-2":
            assert move_all(node, profile, source="host", target="disk") > 0
        elif name == "flood-3":
            assert move_all(node, profile, source="disk", target="remote") > 0

    return move


def warm_up(llm: Any, node: StrataNode, profile: Any) -> None:
    """A cold prompt no round asks, until its blocks are registered: the engine's first connection
    to the directory can time out while two ranks start on two cores, and a round served then
    runs uncached (a miss, as it must), which would leave the later rounds nothing to hit."""
    for attempt in range(3):
        run_round(llm, [ask(9, f"warm-up {attempt}")], {})
        if registered(node, profile) > 0:
            return
    raise AssertionError("the engine's connector never registered a block in the directory")


def load_failures(node: StrataNode) -> float:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{node.extra['status_port']}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "strata_load_failures_total"
    )


def test_two_ranks_answer_as_vllm_alone_and_their_blocks_serve_one(
    checkpoints,  # noqa: F811
    node,
    reference_two,
    reference_one,
    vllm_environment,
    record_property,
):
    profile = profile_of(checkpoints.x)
    env = {**node_env(vllm_environment, node.name), FAIL_KEYS: failing_key(profile)}
    sharing = Sharing()
    measured: dict[str, float] = {}
    llm = engine(checkpoints.x, env, 2, node.transfer("OneRankFails"))
    try:
        warm_up(llm, node, profile)
        problems = serve(
            llm, ROUNDS, reference_two, {}, between=between(node, profile), measured=measured, sharing=sharing
        )
        hits = hit_blocks(node)
        failures = load_failures(node)
    finally:
        shutdown(llm)
    registered(node, profile)
    one: dict[str, float] = {}
    llm = engine(checkpoints.x, node_env(vllm_environment, node.name), 1, node.transfer("FaultyStrataConnector"))
    try:
        problems += serve(llm, ONE_RANK, reference_one, {}, measured=one, sharing=sharing)
        served_one = hit_blocks(node)
    finally:
        shutdown(llm)
    for name, value in {
        **measured,
        **{f"hit_blocks.{tier}": n for tier, n in hits.items()},
        "load_failures": failures,
        "one_rank.cached_tokens": one["cached_tokens"],
        "one_rank.deviation": one["deviation"],
    }.items():
        record_property(name, value)
    assert not problems, "vLLM with Strata at two ranks differs from vLLM alone:\n" + "\n".join(problems)
    assert all(hits[tier] > 0 for tier in ("host", "disk", "remote")), f"hits by tier: {hits}"
    assert failures >= 1, "the block whose copy fails on the second rank was meant to be loaded"
    assert one["cached_tokens"] >= 4 * BLOCK and sum(served_one.values()) > 0, (one, served_one)


def test_the_comparison_fails_when_the_ranks_heads_are_mixed_up(checkpoints, node, reference_two, vllm_environment):  # noqa: F811
    profile = profile_of(checkpoints.x)
    rounds = {name: ROUNDS[name] for name in ("store", "flood-1", "host")}
    llm = engine(checkpoints.x, node_env(vllm_environment, node.name), 2, node.transfer("ShardingOff"))
    try:
        warm_up(llm, node, profile)
        problems = serve(llm, rounds, reference_two, {}, between=between(node, profile))
        hits = hit_blocks(node)
    finally:
        shutdown(llm)
    assert hits["host"] > 0, f"the host round was meant to hit: {hits}"
    assert any("again" in problem for problem in problems), problems
