"""vLLM with Strata answers as vLLM alone does: the same rounds of requests served by both, compared
token by token and by top-5 logprobs at every position (tests/connectors/differential.py), with a
tolerance measured from vLLM alone against itself, and every request's cached tokens held to what
vLLM alone could have shared.

The checkpoint is the multi-hop blend fixture (a trained 8-layer Llama whose answer is a value it
must find through two passages: the answer depends on the context, unlike a random-weight
model's), under two LoRA adapters; and a second checkpoint with the same directory name, file
names, sizes and modification times but other weights. The rounds mix what operators run:
concurrent requests of salted and unsalted tenants and of both adapters, hits sharing steps with
cold prefills, floods that push every prompt out of vLLM's pages between rounds so hits come from
host, then disk, then remote, forged remote values, a request whose blocks cannot be saved in the
same step as hits, and decodes long enough to be preempted.

Then each fix is turned off in turn (tests/connectors/mutants.py) and the same comparison must
fail: LoRA keying, salt keying, content model identity, L3 verification. (Step isolation, the fix
of a step whose planning failed for one request and dropped every request's loads, is held by the
scheduler half's unit test: whether such a request shares a step with loads here depends on when
each lookup comes back, so its mutant was not seen every run.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.connectors.conftest import environment
from tests.connectors.differential import (
    Ask,
    Reference,
    Sharing,
    compare,
    deviation,
    run_round,
    tolerance,
)
from tests.support import RedisServer, free_port, node_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "blend-multihop"
BLOCK = 64
"""Strata's block in these engines: a 259-token question is 4 blocks."""
PAGES = 64
"""vLLM's KV space: 64 pages of 32 tokens (2048 tokens, eight questions)."""
FAULT = (("strata_test_fault", "save"),)


# -- what the engines serve --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Checkpoints:
    x: Path
    y: Path
    """Another checkpoint with x's directory name, file names, sizes and times, other weights."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Checkpoints:
    import torch
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("checkpoints")
    x, y = root / "x" / "multihop", root / "y" / "multihop"
    shutil.copytree(FIXTURE, x)
    shutil.copytree(FIXTURE, y)
    weights = load_file(x / "model.safetensors")
    generator = torch.Generator().manual_seed(7)
    changed = {}
    for name, tensor in weights.items():
        if "self_attn" in name or "mlp" in name:  # another fine-tune: every layer's weights moved
            noise = torch.randn(tensor.shape, generator=generator) * float(tensor.float().std()) * 0.3
            tensor = (tensor.float() + noise).to(tensor.dtype)
        changed[name] = tensor
    save_file(changed, y / "model.safetensors", metadata={"format": "pt"})
    for path in sorted(x.iterdir()):
        twin = y / path.name
        assert twin.stat().st_size == path.stat().st_size, f"{path.name}: the twin must keep the size"
        os.utime(twin, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns))
    assert (x / "model.safetensors").read_bytes() != (y / "model.safetensors").read_bytes()
    return Checkpoints(x=x, y=y)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    """Two LoRA adapters of the checkpoint (rank 8 on the attention projections, K and V included)."""
    import json

    import torch
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("adapters")
    paths = {}
    for seed, name in ((1, "adapter-a"), (2, "adapter-b")):
        generator = torch.Generator().manual_seed(seed)
        tensors = {}
        for layer in range(8):
            for module in ("q_proj", "k_proj", "v_proj", "o_proj"):
                prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(8, 128, generator=generator) * 0.1
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(128, 8, generator=generator) * 0.1
        path = root / name
        path.mkdir()
        save_file(tensors, path / "adapter_model.safetensors")
        (path / "adapter_config.json").write_text(
            json.dumps(
                {
                    "peft_type": "LORA",
                    "r": 8,
                    "lora_alpha": 16,
                    "lora_dropout": 0.0,
                    "bias": "none",
                    "task_type": "CAUSAL_LM",
                    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
                }
            )
        )
        paths[name] = str(path)
    return paths


def questions(count: int, seed: int) -> list[tuple[tuple[int, ...], int]]:
    """Multi-hop questions (259 tokens: 8 passages, QUERY, a binding) and their answers."""
    from benchmarks.models.multihop import MAX_CORPUS, MAX_PASSAGES, draw_question, make_corpus

    rng = random.Random(seed)
    corpus = make_corpus(MAX_CORPUS, rng=rng)
    drawn = [draw_question(rng, corpus, MAX_PASSAGES) for _ in range(count)]
    return [(tuple(q.prompt), q.answer) for q in drawn]


P = [prompt for prompt, _ in questions(10, seed=2026)]
T0, S1, S2 = "", "tenant-1's secret", "c2VjcmV0IG9mIHRlbmFudCAy"  # a salt is any string: base64 too
A, B = "adapter-a", "adapter-b"


def ask(i: int, label: str, *, adapter: str = "", salt: str = "", model: str = "x", **extra: Any) -> Ask:
    return Ask(prompt=P[i], label=label, adapter=adapter, salt=salt, model=model, **extra)


STORE = [
    ask(0, "p0"),
    ask(1, "p1"),
    ask(0, "p0 salt-1", salt=S1),
    ask(2, "p2 salt-1", salt=S1),
    ask(0, "p0 lora-a", adapter=A),
    ask(3, "p3 lora-a", adapter=A),
    ask(0, "p0 lora-b", adapter=B),
    ask(1, "p1 lora-b", adapter=B),
    ask(4, "p4 lora-a salt-1", adapter=A, salt=S1),
]
"""Round 1: every tenant and adapter stores its prompts (cold)."""


def hits_with(*others: Ask) -> list[Ask]:
    """The stored requests again (hits), after cold requests and probes in the same round: the colds
    take the first steps' token budget, so the hits are scheduled in steps where colds are running."""
    return list(others) + [dataclasses.replace(stored, label=f"{stored.label} again") for stored in STORE]


PROBES = [
    ask(0, "p0 salt-2 (another tenant's prompt, not its salt)", salt=S2),
    ask(3, "p3 lora-b (adapter a's prompt)", adapter=B),
    ask(1, "p1 lora-a (adapter b's prompt)", adapter=A),
    ask(4, "p4 lora-a (without the salt)", adapter=A),
    ask(4, "p4 salt-1 (without the adapter)", salt=S1),
    ask(2, "p2 (salt-1's prompt, unsalted)"),
    ask(5, "p5 cold"),
    ask(6, "p6 cold, its blocks cannot be saved", params=FAULT),
]
"""Requests of round 2 that must not share what round 1 stored (another salt, adapter or none)."""

LONGER = Ask(prompt=P[0] + P[9][:125], label="p0 and more, its new blocks cannot be saved", params=FAULT)
"""A hit on p0's four stored blocks whose two new blocks cannot be saved: sent first, its load and
its failing saves are planned in the round's first step, beside the loads of the hits after it."""


def flood(seed: int) -> list[Ask]:
    """Ten fresh questions (2,630 tokens): every earlier prompt leaves vLLM's 64 pages."""
    return [Ask(prompt=prompt, label=f"flood {seed}.{i}") for i, (prompt, _) in enumerate(questions(10, seed=seed))]


ROUNDS: dict[str, list[Ask]] = {
    "store": STORE,
    "flood-1": flood(1),
    "host": hits_with(LONGER, *PROBES),
    "flood-2": flood(2),
    "disk": hits_with(ask(7, "p7 cold, its blocks cannot be saved", params=FAULT), ask(7, "p7 salt-2", salt=S2)),
    "flood-3": flood(3),
    "remote": hits_with(ask(8, "p8 cold, its blocks cannot be saved", params=FAULT), ask(8, "p8 lora-b", adapter=B)),
    "flood-4": flood(4),
    "preempt": [dataclasses.replace(a, max_tokens=160, label=f"{a.label} long") for a in STORE],
}
"""The rounds, in order; between `host`, `disk` and `remote` the stored blocks move down a tier."""

MODEL_Y = [
    ask(0, "p0 on y", model="y"),
    ask(1, "p1 on y", model="y"),
    ask(0, "p0 lora-a on y", model="y", adapter=A),
]


# -- the engines -------------------------------------------------------------------------------------
def engine(
    checkpoint: Path, env: dict[str, str], adapters: dict[str, str], transfer: Any = None, *, stats: bool = False
) -> Any:
    """An engine on `checkpoint`; with `stats`, it keeps vLLM's own counters (`preemptions`)."""
    from vllm import LLM

    with environment(env):
        return LLM(
            model=str(checkpoint),
            dtype="float32",
            skip_tokenizer_init=True,
            enable_lora=True,
            max_lora_rank=8,
            max_loras=2,
            max_model_len=1024,
            block_size=32,
            num_gpu_blocks_override=PAGES,
            max_num_batched_tokens=512,  # a step of two cold prefills: hits join steps where colds run
            kv_transfer_config=transfer,
            disable_log_stats=not stats,
            seed=0,
        )


def preemptions(llm: Any) -> float:
    """How many times the engine's scheduler has preempted a request (vLLM's own counter)."""
    return sum(getattr(metric, "value", 0.0) for metric in llm.get_metrics() if metric.name == "vllm:num_preemptions")


def shutdown(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()


@dataclasses.dataclass
class StrataNode:
    """A node of the test: its options (a private Redis as L3) and the engines opened on it."""

    name: str
    extra: dict[str, Any]
    work: Path

    def transfer(self, connector: str) -> Any:
        from vllm.config import KVTransferConfig

        return KVTransferConfig(
            kv_connector=connector,
            kv_connector_module_path="tests.connectors.mutants",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=self.extra,
        )


@contextlib.contextmanager
def strata_node(remote: RedisServer) -> Iterator[StrataNode]:
    from controlplane.directory.models import Placement
    from controlplane.directory.services import TierReport, node_heartbeat

    # Each node keeps its L3 under a prefix of its own: copies earlier nodes registered there are
    # not in it, and would read as hits vLLM alone could not have had. Forget them.
    Placement.objects.filter(tier="remote").delete()
    name = f"diff-{uuid.uuid4().hex[:6]}"
    work = Path(tempfile.mkdtemp(prefix="strata-diff-"))
    node_heartbeat(
        name=name,
        host="test",
        heartbeat_seconds=3600.0,
        tiers=[TierReport(tier=t, capacity_bytes=1 << 30, used_bytes=0) for t in ("host", "disk")],
    )
    extra = {
        "node_name": name,
        "tiers": "host,disk,remote",
        "block_tokens": BLOCK,
        "host_pool_name": f"strata-test-{name}",
        "host_bytes": "64MiB",
        "disk_path": str(work / "disk"),
        "disk_bytes": "128MiB",
        "remote_url": remote.url,
        "remote_prefix": f"strata-test-{name}",
        "remote_bytes": "128MiB",
        "status_port": free_port(),
        "node_admin_key": f"admin-{name}",
    }
    try:
        yield StrataNode(name=name, extra=extra, work=work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for pool in Path("/dev/shm").glob(f"strata-test-{name}*"):
            pool.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def remote(directory_db) -> Iterator[RedisServer]:
    work = Path(tempfile.mkdtemp(prefix="strata-diff-l3-"))
    server = RedisServer(directory=work)
    server.start()
    yield server
    server.stop()
    shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def node(remote) -> Iterator[StrataNode]:
    with strata_node(remote) as opened:
        yield opened


@pytest.fixture(scope="module")
def plain(checkpoints, adapters, vllm_environment) -> Iterator[Any]:
    llm = engine(checkpoints.x, vllm_environment, adapters)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def reference(plain, adapters) -> Reference:
    ref = Reference(plain, adapters)
    ref.measure(ROUNDS)
    return ref


# -- moving blocks down the tiers as movements do ----------------------------------------------------
def profile_of(checkpoint: Path) -> Any:
    from worker.dataplane.models.loading import checkpoint_profile

    return checkpoint_profile(checkpoint, dtype="float32", block_tokens=BLOCK)


def registered(node: StrataNode, profile: Any) -> int:
    """The model's READY placements of the node (and in L3), once the write-behind registrations
    of the rounds served so far have landed (the count holds still for a second)."""
    import time

    from controlplane.directory.models import Placement
    from worker.dataplane.hashing import model_key

    rows = Placement.objects.filter(state="ready", block__model__model_key=model_key(profile))
    count, deadline = -1, time.monotonic() + 30
    while time.monotonic() < deadline:
        now = rows.filter(node__name=node.name).count() + rows.filter(node__isnull=True).count()
        if now == count:
            return now
        count = now
        time.sleep(1.0)
    raise AssertionError("the node's registrations did not settle within 30 s")


def move_all(node: StrataNode, profile: Any, *, source: str, target: str) -> int:
    """Every READY block of the model on `source` copied to `target` (verified), its new copy
    registered and the old one forgotten, as a movement does; returns how many moved."""
    registered(node, profile)
    from controlplane.directory.models import Placement
    from controlplane.directory.services import blocks_register, placements_change
    from worker.dataplane.directory import BlockRegistration, PlacementChange
    from worker.dataplane.hashing import model_key
    from worker.dataplane.layout import block_layout
    from worker.dataplane.store import build_store

    key = model_key(profile)
    rows = Placement.objects.filter(tier=source, state="ready", block__model__model_key=key).select_related(
        "block", "block__namespace"
    )
    rows = rows.filter(node__isnull=True) if source == "remote" else rows.filter(node__name=node.name)
    from worker.dataplane.connectors.vllm.runtime import node_options

    store = build_store(node_options(node.extra), profile=profile, environ={})
    registrations, changes = [], []
    try:
        for row in rows:
            block = row.block
            copied = store.copy(block.prefix_key, source=source, target=target)
            store.delete(block.prefix_key, tier=source)
            common = dict(namespace=block.namespace.name, model_key=key, prefix_key=block.prefix_key)
            registrations.append(
                BlockRegistration(
                    **common,
                    content_key=block.content_key,
                    position=block.position,
                    tokens=BLOCK,
                    tier=target,
                    node=None if target == "remote" else node.name,
                    nbytes=block_layout(profile).block_bytes,
                    checksum=copied.checksum.hex,
                )
            )
            changes.append(
                PlacementChange(**common, tier=source, node=None if source == "remote" else node.name, action="delete")
            )
    finally:
        store.close()
    blocks_register(registrations=registrations)
    placements_change(changes=changes)
    return len(registrations)


FORGED = (0,)
"""The prompts (of P) whose second block is forged in L3 for the base model without a salt:
"p0 again" of the remote round must recompute from it; the others load from L3."""
DONOR = 1
"""The prompt whose second block's bytes the forged values hold (p1, stored in the first round)."""


def forge_remote(node: StrataNode, profile: Any) -> list[uuid.UUID]:
    """Overwrite the second block of prompts FORGED in L3 with self-consistent values holding
    another prompt's second block (what any holder of the Redis URL can write: each value's own
    checksums match its bytes); the directory still registers the genuine checksums. Returns the
    forged keys."""
    from controlplane.directory.models import Namespace
    from worker.dataplane.connectors.vllm.runtime import node_options
    from worker.dataplane.hashing import Fingerprinter
    from worker.dataplane.store import build_store

    salt = Namespace.objects.get(name="default").salt_bytes
    second = [Fingerprinter.for_profile(profile, ns_salt=salt).prefix_keys(P[i])[1] for i in (*FORGED, DONOR)]
    store = build_store(node_options(node.extra), profile=profile, environ={})
    try:
        remote = store.tier("remote")
        assert all(remote.contains_many(second)), "the blocks to forge and their donor are in L3"
        donor = store.get(second[-1], tiers=["remote"]).data
        for key in second[:-1]:
            remote.put(key, donor)
    finally:
        store.close()
    return second[:-1]


# -- running the rounds ------------------------------------------------------------------------------
Between = Callable[[str], None]


def serve(
    llm: Any,
    rounds: dict[str, list[Ask]],
    reference: Reference,
    adapters: dict[str, str],
    *,
    between: Between | None = None,
    measured: dict[str, float] | None = None,
    sharing: Sharing | None = None,
) -> list[str]:
    """Serve the rounds in order (calling `between(name)` before each) and return every problem:
    answers that differ from vLLM alone's, and cached tokens vLLM alone could not have shared.
    `measured` receives the largest deviation from vLLM alone and the cached tokens; `sharing`
    carries what earlier rounds asked when the rounds are served in parts."""
    tol = tolerance(reference.noise)
    sharing = sharing if sharing is not None else Sharing()
    problems: list[str] = []
    worst, cached = 0.0, 0
    for name, asks in rounds.items():
        if between is not None:
            between(name)
        got = run_round(llm, asks, adapters)
        want = reference.of(name, asks)
        problems += [f"[{name}] {p}" for p in compare(asks, want, got, tol)]
        problems += [f"[{name}] {p}" for p in sharing.check(asks, got)]
        worst = max(worst, *(deviation(a, b) for a, b in zip(want, got, strict=True)))
        cached += sum(answer.cached for answer in got)
    if measured is not None:
        measured.update(deviation=worst, cached_tokens=cached, noise=reference.noise, tolerance=tol)
    return problems


def tier_moves(node: StrataNode, profile: Any) -> Between:
    def between(name: str) -> None:
        if name == "host":
            registered(node, profile)  # the stored blocks are in the directory before they are asked again
        elif name == "flood-2":
            assert move_all(node, profile, source="host", target="disk") > 0
        elif name == "flood-3":
            assert move_all(node, profile, source="disk", target="remote") > 0
            forge_remote(node, profile)

    return between


def hit_blocks(node: StrataNode) -> dict[str, float]:
    """Blocks the node's connector served, by tier (its /metrics)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{node.extra['status_port']}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found: dict[str, float] = {"host": 0.0, "disk": 0.0, "remote": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "strata_hit_blocks_total":
                found[sample.labels["tier"]] = found.get(sample.labels["tier"], 0.0) + sample.value
    return found


# -- the tests ---------------------------------------------------------------------------------------
def test_the_checkpoint_s_answers_depend_on_their_context(reference):
    """What the comparison rests on: the fixture answers its questions from their passages, and
    the adapters change its answers (a random-weight model answers one token whatever it is asked)."""
    store = reference.of("store", STORE)
    answers = {a.label: b.tokens[0] for a, b in zip(STORE, store, strict=True)}
    truth = dict(questions(10, seed=2026))
    right = sum(answers[label] == truth[P[i]] for i, label in ((0, "p0"), (1, "p1")))
    assert right == 2, "the fixture answers its questions from their passages"
    assert len(set(answers.values())) >= 3
    by_label = dict(zip((a.label for a in STORE), store, strict=True))
    for one, other in (("p0", "p0 lora-a"), ("p0", "p0 lora-b"), ("p0 lora-a", "p0 lora-b"), ("p0", "p0 salt-1")):
        moved = deviation(by_label[one], by_label[other])
        # The adapters change the KV and the answers' logprobs far beyond the tolerance; a salt changes nothing.
        assert (moved > 100 * tolerance(reference.noise)) == ("salt" not in other), (one, other, moved)
    assert reference.noise < 1e-3, f"vLLM alone strays {reference.noise} from itself"


def test_vllm_with_strata_answers_as_vllm_alone(
    checkpoints, adapters, node, reference, vllm_environment, record_property
):
    profile = profile_of(checkpoints.x)
    llm = engine(
        checkpoints.x,
        node_env(vllm_environment, node.name),
        adapters,
        node.transfer("FaultyStrataConnector"),
        stats=True,
    )
    measured: dict[str, float] = {}
    last: dict[str, float] = {}
    sharing = Sharing()
    rounds = {name: asks for name, asks in ROUNDS.items() if name != "preempt"}
    try:
        problems = serve(
            llm, rounds, reference, adapters, between=tier_moves(node, profile), measured=measured, sharing=sharing
        )
        start = preemptions(llm)
        problems += serve(llm, {"preempt": ROUNDS["preempt"]}, reference, adapters, measured=last, sharing=sharing)
        preempted = preemptions(llm) - start
        hits = hit_blocks(node)
    finally:
        shutdown(llm)
    measured["deviation"] = max(measured["deviation"], last["deviation"])
    measured["cached_tokens"] += last["cached_tokens"]
    figures = {**measured, "preemptions": preempted, **{f"hit_blocks.{tier}": n for tier, n in hits.items()}}
    for name, value in figures.items():
        record_property(name, value)  # in the JUnit report (--junitxml): the figures of the run
    assert not problems, "vLLM with Strata differs from vLLM alone:\n" + "\n".join(problems)
    assert all(hits[tier] > 0 for tier in ("host", "disk", "remote")), f"hits by tier: {hits}"
    assert preempted > 0, "the long decodes of the last round were meant to be preempted"


@pytest.fixture(scope="module")
def reference_y(checkpoints, adapters, vllm_environment) -> Reference:
    """vLLM alone's answers on y (its engine closed once they are measured)."""
    plain_y = engine(checkpoints.y, vllm_environment, adapters)
    try:
        measured = Reference(plain_y, adapters)
        measured.measure({"y": MODEL_Y})
    finally:
        shutdown(plain_y)
    return measured


def test_a_model_with_another_s_names_sizes_and_times_never_gets_its_blocks(
    checkpoints, adapters, node, reference_y, vllm_environment
):
    """Runs after the x rounds: the node's tiers hold x's blocks for the same prompts."""
    assert profile_of(checkpoints.x).revision != profile_of(checkpoints.y).revision
    llm = engine(checkpoints.y, node_env(vllm_environment, node.name), adapters, node.transfer("FaultyStrataConnector"))
    try:
        problems = serve(llm, {"y": MODEL_Y}, reference_y, adapters)
    finally:
        shutdown(llm)
    assert not problems, "\n".join(problems)


MUTANT_ROUNDS = {name: ROUNDS[name] for name in ("store", "flood-1", "host")}


def mutant_moves(node: StrataNode, profile: Any, mutant: str) -> Between:
    """Before `host`, the stored blocks' registrations land; for L3VerificationOff, before
    `flood-2` the stored blocks move from host to L3 and p0's second block is forged there."""

    def between(name: str) -> None:
        if name == "host":
            registered(node, profile)
        elif name == "flood-2" and mutant == "L3VerificationOff":
            assert move_all(node, profile, source="host", target="remote") > 0
            forge_remote(node, profile)

    return between


@pytest.mark.parametrize(
    ("mutant", "rounds", "expected"),
    [
        ("LoraKeyingOff", MUTANT_ROUNDS, ("lora", ": position")),
        ("SaltKeyingOff", MUTANT_ROUNDS, ("[host] p0 salt-2 (another tenant's prompt", "cached tokens, vLLM alone")),
        ("L3VerificationOff", {name: ROUNDS[name] for name in ("store", "flood-2", "remote")}, ("[remote] p0 again",)),
    ],
)
def test_the_comparison_fails_with_a_fix_turned_off(
    mutant, rounds, expected, checkpoints, adapters, remote, reference, vllm_environment, record_property
):
    """Each fix guards against something the differential test sees: with it off (and nothing else
    changed), the same rounds on a node of their own differ from vLLM alone, in the way the fix
    is about (`expected`: the parts of one problem's line). A LoRA or model mix-up moves logprobs;
    a salt does not change the KV, so sharing across salts shows as cached tokens vLLM alone could
    not have had."""
    profile = profile_of(checkpoints.x)
    with strata_node(remote) as fresh:
        llm = engine(checkpoints.x, node_env(vllm_environment, fresh.name), adapters, fresh.transfer(mutant))
        try:
            measured: dict[str, float] = {}
            between = mutant_moves(fresh, profile, mutant)
            problems = serve(llm, rounds, reference, adapters, between=between, measured=measured)
            hits = hit_blocks(fresh)
        finally:
            shutdown(llm)
    record_property("hit_blocks", hits)
    record_property("deviation", measured["deviation"])
    record_property("problems", len(problems))
    record_property("first_problems", problems[:3])
    assert sum(hits.values()) > 0, "the node served no hits: no fix could be seen at work"
    assert any(all(part in problem for part in expected) for problem in problems), f"{mutant} went unseen: {problems}"


def test_the_comparison_fails_without_content_model_identity(
    checkpoints, adapters, remote, reference, reference_y, vllm_environment, record_property
):
    """Two nodes keying models by their files' names, sizes and times: y, served on the node after
    x stored its blocks there, is served x's blocks."""
    with strata_node(remote) as fresh:
        transfer = fresh.transfer("ContentIdentityOff")
        x = engine(checkpoints.x, node_env(vllm_environment, fresh.name), adapters, transfer)
        try:
            assert not serve(x, {"store": STORE}, reference, adapters)  # x is served right
        finally:
            shutdown(x)
        y = engine(checkpoints.y, node_env(vllm_environment, fresh.name), adapters, transfer)
        try:
            measured: dict[str, float] = {}
            problems = serve(y, {"y": MODEL_Y}, reference_y, adapters, measured=measured)
        finally:
            shutdown(y)
    record_property("deviation", measured["deviation"])
    record_property("problems", len(problems))
    record_property("first_problems", problems[:3])
    assert any("on y" in problem for problem in problems), f"content identity off went unseen: {problems}"
