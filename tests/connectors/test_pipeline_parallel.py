"""vLLM with Strata at pipeline parallel 2 (two stages of four layers, a core each) answers as vLLM
alone at pipeline parallel 2 (the differential protocol of test_differential, on its checkpoint),
with hits from host, disk and remote: each stage loads its own layers of a block, and the stages'
shares of each saved block meet on the first stage's save queue, which stores the whole block.
The blocks written by two stages serve a one-rank server, which answers as vLLM alone at one
rank. With each stage reading the first stage's layers (StagesOff) the comparison fails.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.connectors.differential import Sharing
from tests.connectors.test_differential import (
    BLOCK,
    Reference,
    StrataNode,
    checkpoints,  # noqa: F401 - the module's fixture
    hit_blocks,
    profile_of,
    registered,
    remote,  # noqa: F401 - the module's fixture
    serve,
    shutdown,
    strata_node,
)
from tests.connectors.test_tensor_parallel import ONE_RANK, ROUNDS, between, engine, measured_reference, warm_up
from tests.support import node_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def reference_stages(checkpoints, vllm_environment) -> Reference:  # noqa: F811 - the imported fixture
    return measured_reference(checkpoints.x, vllm_environment, 1, ROUNDS, stages=2)


@pytest.fixture(scope="module")
def reference_one(checkpoints, vllm_environment) -> Reference:  # noqa: F811
    return measured_reference(checkpoints.x, vllm_environment, 1, ONE_RANK)


@pytest.fixture
def node(remote) -> Iterator[StrataNode]:  # noqa: F811 - the imported fixture
    with strata_node(remote) as opened:
        yield opened


def test_two_stages_answer_as_vllm_alone_and_their_blocks_serve_one_rank(
    checkpoints,  # noqa: F811
    node,
    reference_stages,
    reference_one,
    vllm_environment,
    record_property,
):
    profile = profile_of(checkpoints.x)
    env = node_env(vllm_environment, node.name)
    measured: dict[str, float] = {}
    sharing = Sharing()
    llm = engine(checkpoints.x, env, 1, node.transfer("FaultyStrataConnector"), stages=2)
    try:
        warm_up(llm, node, profile)
        problems = serve(
            llm, ROUNDS, reference_stages, {}, between=between(node, profile), measured=measured, sharing=sharing
        )
        hits = hit_blocks(node)
    finally:
        shutdown(llm)
    registered(node, profile)
    one: dict[str, float] = {}
    llm = engine(checkpoints.x, env, 1, node.transfer("FaultyStrataConnector"))
    try:
        problems += serve(llm, ONE_RANK, reference_one, {}, measured=one, sharing=sharing)
        served_one = hit_blocks(node)
    finally:
        shutdown(llm)
    for name, value in {
        **measured,
        **{f"hit_blocks.{tier}": n for tier, n in hits.items()},
        "one_rank.cached_tokens": one["cached_tokens"],
        "one_rank.deviation": one["deviation"],
    }.items():
        record_property(name, value)
    assert not problems, "vLLM with Strata at two stages differs from vLLM alone:\n" + "\n".join(problems)
    assert all(hits[tier] > 0 for tier in ("host", "disk", "remote")), f"hits by tier: {hits}"
    assert one["cached_tokens"] >= 4 * BLOCK and sum(served_one.values()) > 0, (one, served_one)


def test_the_comparison_fails_when_each_stage_reads_the_first_stage_s_layers(
    checkpoints,  # noqa: F811
    node,
    reference_stages,
    vllm_environment,
):
    profile = profile_of(checkpoints.x)
    rounds = {name: ROUNDS[name] for name in ("store", "flood-1", "host")}
    llm = engine(checkpoints.x, node_env(vllm_environment, node.name), 1, node.transfer("StagesOff"), stages=2)
    try:
        warm_up(llm, node, profile)
        problems = serve(llm, rounds, reference_stages, {}, between=between(node, profile))
        hits = hit_blocks(node)
    finally:
        shutdown(llm)
    assert hits["host"] > 0, f"the host round was meant to hit: {hits}"
    assert any("again" in problem for problem in problems), problems
