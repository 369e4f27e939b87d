"""Cache-aware generation: a hit from any tier gives exactly the tokens of a cold run."""

from __future__ import annotations

import logging
import os
import random
import re
import threading
import time

import pytest
import torch

from tests.engine.conftest import BLOCK_TOKENS, engine_for
from worker.dataplane.blend.options import BlendOptions
from worker.dataplane.offload_records import Throughput

TIERS = ["device", "host", "disk", "remote"]


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 259) for _ in range(length - 1)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tier", TIERS)
def test_hit_from_each_tier_is_exact(models, make_store, tier, dtype):
    model = models("tiny", dtype)
    store = make_store(model, (tier,))
    engine = engine_for(model, store)
    prompt = prompt_of(203, seed=1)
    cold = engine.generate(prompt, max_tokens=12, use_cache=False)
    first = engine.generate(prompt, max_tokens=12)
    assert first.trace.cached_tokens == 0 and first.trace.written_blocks == (203 + 11) // BLOCK_TOKENS
    warm = engine.generate(prompt, max_tokens=12)
    assert warm.trace.hit_blocks_by_tier == {tier: 203 // BLOCK_TOKENS}
    assert warm.trace.cached_tokens == (203 // BLOCK_TOKENS) * BLOCK_TOKENS
    assert warm.output_ids == cold.output_ids == first.output_ids
    # Bit for bit: a cold prompt's full blocks are prefilled first and the rest on its own, which
    # is exactly what a hit of every full block computes (matrix kernels that round by row count,
    # bfloat16 on AMX for one, cannot flip a near-tie greedy token between the two).
    assert torch.equal(warm.first_logits, cold.first_logits)
    assert torch.equal(warm.first_logits, first.first_logits)


@pytest.mark.parametrize("family", ["tiny-qwen2", "tiny-mistral"])
def test_other_families_through_the_same_path(models, make_store, family):
    model = models(family)
    engine = engine_for(model, make_store(model, ("host",)))
    prompt = prompt_of(100, seed=2)
    cold = engine.generate(prompt, max_tokens=8, use_cache=False)
    engine.generate(prompt, max_tokens=8)
    warm = engine.generate(prompt, max_tokens=8)
    assert warm.trace.cached_tokens == 96 and warm.output_ids == cold.output_ids


def test_layerwise_and_load_then_compute_agree(models, make_store):
    model = models("tiny")
    engine = engine_for(model, make_store(model, ("disk",)))
    prompt = prompt_of(160, seed=3)
    engine.generate(prompt, max_tokens=4)
    layerwise = engine.generate(prompt, max_tokens=6, layerwise=True)
    upfront = engine.generate(prompt, max_tokens=6, layerwise=False)
    assert layerwise.output_ids == upfront.output_ids
    assert layerwise.trace.layerwise and not upfront.trace.layerwise
    assert len(layerwise.trace.layer_stall_s) == model.layers
    assert len(layerwise.trace.layer_loaded_at_s) == model.layers


def test_whole_prompt_cached_still_computes_the_last_token(models, make_store):
    model = models("tiny")
    engine = engine_for(model, make_store(model, ("host",)))
    prompt = prompt_of(4 * BLOCK_TOKENS, seed=4)
    cold = engine.generate(prompt, max_tokens=5, use_cache=False)
    engine.generate(prompt, max_tokens=5)
    warm = engine.generate(prompt, max_tokens=5)
    assert warm.trace.cached_tokens == 4 * BLOCK_TOKENS - 1
    assert warm.output_ids == cold.output_ids


def test_multi_turn_reuses_the_previous_turn(models, make_store):
    model = models("tiny")
    engine = engine_for(model, make_store(model, ("host",)))
    turn1 = prompt_of(90, seed=5)
    reply = engine.generate(turn1, max_tokens=20).output_ids
    turn2 = turn1 + reply + prompt_of(40, seed=6)[1:]
    second = engine.generate(turn2, max_tokens=5)
    # Everything of turn 1 and its reply that fills whole blocks is reused.
    assert second.trace.cached_tokens == ((90 + 19) // BLOCK_TOKENS) * BLOCK_TOKENS
    cold = engine.generate(turn2, max_tokens=5, use_cache=False)
    torch.testing.assert_close(second.first_logits, cold.first_logits, rtol=1e-4, atol=1e-4)


def test_namespaces_never_share_blocks(models, make_store):
    model = models("tiny")
    engine = engine_for(model, make_store(model, ("host",)))
    prompt = prompt_of(120, seed=7)
    engine.generate(prompt, max_tokens=3, namespace="tenant-a")
    other = engine.generate(prompt, max_tokens=3, namespace="tenant-b")
    same = engine.generate(prompt, max_tokens=3, namespace="tenant-a")
    assert other.trace.cached_tokens == 0
    assert same.trace.cached_tokens == 112


def test_concurrent_requests_do_not_interfere(models, make_store):
    model = models("tiny")
    engine = engine_for(model, make_store(model, ("host",)))
    prompts = [prompt_of(70 + 13 * i, seed=10 + i) for i in range(6)]
    expected = [engine.generate(p, max_tokens=8, use_cache=False).output_ids for p in prompts]
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        results[i] = engine.generate(prompts[i], max_tokens=8).output_ids

    threads = [threading.Thread(target=run, args=(i % 6,)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [results[i] for i in range(6)] == expected


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_block_in_the_middle_is_recomputed_and_counted(models, make_store, damage):
    model = models("tiny")
    store = make_store(model, ("disk",))
    engine = engine_for(model, store)
    prompt = prompt_of(130, seed=20)
    cold = engine.generate(prompt, max_tokens=8, use_cache=False)
    engine.generate(prompt, max_tokens=8)
    victim = engine.fingerprinter("default").blocks(prompt)[3].prefix_key
    disk = store.tier("disk")
    path = disk.path_of(victim)
    if damage == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        with open(path, "r+b") as handle:
            handle.truncate(path.stat().st_size // 2)
    else:
        path.unlink()
    warm = engine.generate(prompt, max_tokens=8)
    assert warm.output_ids == cold.output_ids
    assert warm.trace.cached_tokens == 3 * BLOCK_TOKENS
    if damage != "delete":
        assert warm.trace.load_failures == 1
        assert engine.counters.get("load_failures") == 1
        assert store.stats().get("disk.corrupt", 0) == 1
    else:  # gone before the request: a lookup miss, nothing was loaded that could fail
        assert warm.trace.load_failures == 0 and engine.counters.get("load_failures") == 0
    # The bad copy was quarantined and the block written back again: the next run hits it all.
    again = engine.generate(prompt, max_tokens=8)
    assert again.trace.cached_tokens == (130 // BLOCK_TOKENS) * BLOCK_TOKENS
    assert again.output_ids == cold.output_ids


def lose_during_the_load(store, victim, damage: str) -> list[int]:
    """Make `victim` vanish (or rot) when the engine's loader asks for layer 1 of the hit blocks:
    after the lookup found it and the load was planned, with layer 0 read or on its way. Both read
    paths of the loader go through the store (`get_layers` from its thread, `read_layers` inline)."""
    lost: list[int] = []
    get_layers, read_layers = store.get_layers, store.read_layers

    def lose(layers) -> None:
        if layers != 1 or lost:
            return
        lost.append(1)
        if damage == "delete":
            assert store.delete(victim)
            return
        path = store.tier("disk").path_of(victim)
        with open(path, "r+b") as handle:  # one flipped byte in the last layer (layer 1)
            handle.seek(os.path.getsize(path) - 100)
            byte = handle.read(1)
            handle.seek(os.path.getsize(path) - 100)
            handle.write(bytes([byte[0] ^ 0xFF]))

    def get_layers_losing(keys, *, layers, **kwargs):
        lose(layers)
        return get_layers(keys, layers=layers, **kwargs)

    def read_layers_losing(keys, *, layers, **kwargs):
        lose(layers)
        return read_layers(keys, layers=layers, **kwargs)

    store.get_layers, store.read_layers = get_layers_losing, read_layers_losing
    return lost


@pytest.mark.parametrize(
    ("tier", "damage", "layerwise"),
    [
        ("disk", "delete", True),
        ("disk", "corrupt", True),
        ("host", "delete", True),
        ("device", "delete", True),
        ("remote", "delete", True),
        ("disk", "delete", False),
        ("disk", "corrupt", False),
    ],
)
def test_a_block_lost_during_the_load_is_recomputed_and_counted(models, make_store, tier, damage, layerwise):
    model = models("tiny")
    store = make_store(model, (tier,))
    engine = engine_for(model, store)
    prompt = prompt_of(130, seed=21)
    cold = engine.generate(prompt, max_tokens=8, use_cache=False)
    engine.generate(prompt, max_tokens=8)
    victim = engine.fingerprinter("default").blocks(prompt)[3].prefix_key
    lost = lose_during_the_load(store, victim, damage)
    warm = engine.generate(prompt, max_tokens=8, layerwise=layerwise)
    assert lost == [1]
    # Looked up as 8 hit blocks; block 3 failed while loading: the request recomputes from it.
    assert warm.output_ids == cold.output_ids
    assert warm.trace.cached_tokens == 3 * BLOCK_TOKENS and warm.trace.hit_blocks_by_tier == {tier: 3}
    assert warm.trace.load_failures == 1 and engine.counters.get("load_failures") == 1
    assert engine.counters.get("hit_blocks." + tier) == 3  # only what was served counts as a hit
    if damage == "corrupt":
        assert store.stats().get("disk.corrupt", 0) == 1
    # The block was written back from the recompute: the next request hits every block again.
    again = engine.generate(prompt, max_tokens=8)
    assert again.trace.cached_tokens == (130 // BLOCK_TOKENS) * BLOCK_TOKENS and again.trace.load_failures == 0
    assert again.output_ids == cold.output_ids


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt_ids": [], "max_tokens": 3}, "prompt: at least one token"),
        ({"prompt_ids": [1, 2], "max_tokens": 0}, "max_tokens: must be at least 1"),
        ({"prompt_ids": [5] * 4090, "max_tokens": 10}, "exceed the model's context of 4096"),
    ],
)
def test_bad_requests_are_refused(models, make_store, kwargs, message):
    model = models("tiny")
    engine = engine_for(model, make_store(model, ("host",)))
    with pytest.raises(ValueError, match=message):
        engine.generate(kwargs.pop("prompt_ids"), **kwargs)


def test_load_or_recompute_follows_the_measured_speeds(models, make_store):
    model = models("tiny")
    store = make_store(model, ("disk",))
    engine = engine_for(model, store, decide=True)
    prompt = prompt_of(150, seed=30)
    cold = engine.generate(prompt, max_tokens=4)
    assert cold.trace.decision == "no-hit"
    assert engine.prefill_speed.value is not None  # measured on the cold prefill
    first_hit = engine.generate(prompt, max_tokens=4)
    assert first_hit.trace.decision == "load"  # no speed known for the tier yet: try it and measure
    assert engine.tier_speed["disk"].value is not None
    # A tier measured far slower than computing the same tokens: recompute, same output.
    engine.tier_speed["disk"].value = 1.0  # bytes per second
    slow = engine.generate(prompt, max_tokens=4)
    assert slow.trace.decision == "recompute" and slow.trace.cached_tokens == 0
    assert slow.output_ids == cold.output_ids
    engine.tier_speed["disk"].value = 1e15
    fast = engine.generate(prompt, max_tokens=4)
    assert fast.trace.decision == "load" and fast.trace.cached_tokens == 144
    counts = engine.counters.snapshot()
    assert counts["decision.no_hit"] == 1 and counts["decision.recompute"] == 1 and counts["decision.load"] == 2


def slowed(tier, seconds: float):
    """The tier's reads, each delayed by `seconds` (the medium slowed under the engine)."""
    original = tier.get_layers

    def get_layers(keys, layers, outs):
        time.sleep(seconds)
        return original(keys, layers, outs)

    return get_layers


def test_a_tier_judged_too_slow_is_measured_again_and_comes_back(models, make_store, monkeypatch):
    model = models("small")
    store = make_store(model, ("host",))
    engine = engine_for(model, store, decide=True, reprobe_seconds=30.0)
    now = [1000.0]
    engine.offload.clock = lambda: now[0]
    prompt = prompt_of(600, seed=31)
    cold = engine.generate(prompt, max_tokens=4)
    # Computing the cached tokens is held at 0.2 s, so only the host tier's measured speed moves
    # the decision: about 1 ms healthy, over 2 s slowed (a margin no load on this machine bridges).
    monkeypatch.setattr(engine.offload, "observe_prefill", lambda tokens, seconds: None)
    engine.prefill_speed.value = 592 / 0.2
    assert engine.generate(prompt, max_tokens=4).trace.decision == "load"  # unknown: tried
    assert engine.generate(prompt, max_tokens=4).trace.decision == "load"  # measured: reading beats computing
    fast_estimate = engine.tier_speed["host"].value

    # The host tier slows down while the node is idle: the first read after the pause replaces the old
    # average, so the next request already recomputes.
    host = store.tier("host")
    healthy = host.get_layers
    monkeypatch.setattr(host, "get_layers", slowed(host, 0.5))
    now[0] += 60
    assert engine.generate(prompt, max_tokens=4).trace.decision == "load"
    assert engine.tier_speed["host"].value < fast_estimate / 10
    slow_runs = [engine.generate(prompt, max_tokens=4) for _ in range(3)]
    assert [r.trace.decision for r in slow_runs] == ["recompute"] * 3
    assert all(r.output_ids == cold.output_ids for r in slow_runs)

    # Still slow when its estimate grows stale: one request re-probes, measures it slow again, and
    # the ones after it recompute until the next interval.
    now[0] += 31
    probe = engine.generate(prompt, max_tokens=4)
    assert probe.trace.decision == "load" and probe.output_ids == cold.output_ids
    assert engine.generate(prompt, max_tokens=4).trace.decision == "recompute"
    now[0] += 10
    assert engine.generate(prompt, max_tokens=4).trace.decision == "recompute"

    # The medium recovers: nothing reads it until the estimate is stale, then one re-probe is
    # enough to bring every request back to loading.
    monkeypatch.setattr(host, "get_layers", healthy)
    assert engine.generate(prompt, max_tokens=4).trace.decision == "recompute"
    now[0] += 31
    back = engine.generate(prompt, max_tokens=4)
    assert back.trace.decision == "load" and back.output_ids == cold.output_ids
    assert engine.tier_speed["host"].value > fast_estimate / 10
    after = [engine.generate(prompt, max_tokens=4) for _ in range(3)]
    assert [r.trace.decision for r in after] == ["load"] * 3 and after[0].trace.cached_tokens == 592
    counts = engine.counters.snapshot()
    assert counts["decision.reprobe"] == 2


def test_reprobing_can_be_turned_off_and_refuses_a_bad_interval(models, make_store):
    model = models("tiny")
    store = make_store(model, ("disk",))
    engine = engine_for(model, store, decide=True, reprobe_seconds=None)
    now = [0.0]
    engine.offload.clock = lambda: now[0]
    prompt = prompt_of(150, seed=32)
    engine.generate(prompt, max_tokens=2)
    engine.generate(prompt, max_tokens=2)
    engine.tier_speed["disk"].value = 1.0
    now[0] += 3600
    assert engine.generate(prompt, max_tokens=2).trace.decision == "recompute"  # never measured again
    for bad in (0, -5.0):
        with pytest.raises(ValueError, match="reprobe_seconds: a positive number of seconds"):
            engine_for(model, store, decide=True, reprobe_seconds=bad)


def test_a_stale_estimate_is_replaced_by_a_fresh_reading():
    speed = Throughput(stale_after=30.0)
    speed.observe(1000, 1.0, now=0.0)
    speed.observe(10, 1.0, now=5.0)  # fresh: blended
    assert speed.value == pytest.approx(0.7 * 1000 + 0.3 * 10)
    speed.observe(10, 1.0, now=40.0)  # 35 s after the last reading: replaced
    assert speed.value == 10 and speed.age(50.0) == 10.0
    assert Throughput().is_stale(1e9) is False  # without stale_after an estimate never expires


DECISION = re.compile(r"^request (req-\d+): (no-hit|load|recompute), (\d+) of (\d+) prompt tokens cached")


def decision_lines(caplog) -> list[tuple[str, int, str]]:
    """(message, level, request id) of each load-or-recompute decision the engine logged."""
    lines = []
    for record in caplog.records:
        found = DECISION.match(record.getMessage()) if record.name == "strata.engine" else None
        if found:
            lines.append((record.getMessage(), record.levelno, found.group(1)))
    return lines


def test_every_decision_is_logged_once_per_request_with_its_estimates(models, make_store, caplog):
    model = models("tiny")
    store = make_store(model, ("disk",))
    engine = engine_for(model, store, decide=True)
    prompt = prompt_of(150, seed=30)
    caplog.set_level(logging.DEBUG, logger="strata.engine")
    engine.generate(prompt, max_tokens=2)  # no hit: the prefill speed is measured
    engine.generate(prompt, max_tokens=2)  # the disk's speed is not known yet: loaded and measured
    engine.tier_speed["disk"].value = 1.0
    engine.generate(prompt, max_tokens=2)  # far too slow to read: recomputed
    engine.tier_speed["disk"].value = 1e15
    engine.generate(prompt, max_tokens=2)
    lines = decision_lines(caplog)
    assert [request for _, _, request in lines] == ["req-1", "req-2", "req-3", "req-4"]  # one line each
    (cold, _, _), (unknown, _, _), (slow, slow_level, _), (fast, fast_level, _) = lines
    assert cold.startswith("request req-1: no-hit, 0 of 150 prompt tokens cached")
    assert re.search(
        r"req-2: load, 144 of 150 prompt tokens cached \(disk 9 blocks\): load unknown, "
        r"recompute ~\d+\.\d+s$",
        unknown,
    )
    assert re.search(
        r"req-3: recompute, 144 of 150 prompt tokens cached \(disk 9 blocks\): "
        r"load ~\d+\.\d+s, recompute ~\d+\.\d+s$",
        slow,
    )
    assert re.search(r"req-4: load, 144 .*: load ~0\.0000s, recompute ~\d+\.\d+s$", fast)
    # Recomputing what is cached is what an operator looks for; loading it is the normal case.
    assert slow_level == logging.INFO and fast_level == logging.DEBUG
    assert [level for _, level, _ in lines].count(logging.INFO) == 1
    counts = engine.counters.snapshot()
    assert (counts["decision.no_hit"], counts["decision.load"], counts["decision.recompute"]) == (1, 2, 1)

    # Without deciding, every hit is loaded: still counted and logged.
    caplog.clear()
    plain = engine_for(model, store, decide=False)
    plain.generate(prompt, max_tokens=2)
    ((line, level, _),) = decision_lines(caplog)
    assert line.endswith("load unknown, recompute unknown (deciding is off)") and level == logging.DEBUG
    assert plain.counters.get("decision.load") == 1


def test_a_mixed_tier_hit_measures_every_tier_it_read(models, make_store):
    model = models("tiny")
    store = make_store(model, ("host", "disk"))
    engine = engine_for(model, store, write_back_tier="host", decide=True)
    prompt = prompt_of(150, seed=33)
    cold = engine.generate(prompt, max_tokens=4)
    # The last four blocks move down to disk: the next request reads five from host, four from disk.
    for print_ in engine.fingerprinter("default").blocks(prompt)[5:]:
        store.copy(print_.prefix_key, source="host", target="disk")
        store.delete(print_.prefix_key, tier="host")
    assert engine.tier_speed["host"].value is None and engine.tier_speed["disk"].value is None
    mixed = engine.generate(prompt, max_tokens=4)
    assert mixed.trace.hit_blocks_by_tier == {"host": 5, "disk": 4}
    assert mixed.trace.decision == "load" and mixed.output_ids == cold.output_ids
    # Both tiers measured: the next mixed request is decided on known speeds, not loaded blind.
    assert engine.tier_speed["host"].value > 0 and engine.tier_speed["disk"].value > 0
    assert engine.tier_speed["remote"].value is None and engine.tier_speed["device"].value is None
    engine.tier_speed["disk"].value = 1.0  # the disk's share alone takes longer than recomputing
    assert engine.generate(prompt, max_tokens=4).trace.decision == "recompute"


def test_a_blended_request_measures_the_tiers_it_read(models, make_store):
    model = models("tiny")
    store = make_store(model, ("host",))
    engine = engine_for(model, store, blend=BlendOptions(enabled=True, sample_rate=0.0))
    passages = [prompt_of(2 * BLOCK_TOKENS + 1, seed=80 + i)[1:] for i in range(2)]
    for i, passage in enumerate(passages):
        lead = prompt_of(5 + i, seed=90 + i)
        engine.generate([*lead, *passage], max_tokens=1, segments=[[len(lead), len(lead) + len(passage)]])
    assert engine.tier_speed["host"].value is None  # nothing was read from it yet
    prompt = [*prompt_of(9, seed=95), *passages[1], *passages[0], 7]
    blended = engine.generate(prompt, max_tokens=1, write_back=False)
    assert blended.trace.blend == "blend" and blended.trace.fragment_tokens == 4 * BLOCK_TOKENS
    assert blended.trace.fragment_blocks_by_tier == {"host": 4}
    assert engine.tier_speed["host"].value > 0
    engine.close()


def test_device_pool_keeps_the_most_recent_blocks_within_capacity(models, make_store):
    model = models("tiny")
    store = make_store(model, ("device", "host"), blocks=4)
    engine = engine_for(model, store, write_back_tier="host", keep_in_device=True)
    first, second = prompt_of(5 * BLOCK_TOKENS + 3, seed=40), prompt_of(3 * BLOCK_TOKENS + 3, seed=41)
    engine.generate(first, max_tokens=1)
    assert store.tier("device").usage().blocks == 4 and engine.counters.get("device.evicted") == 1
    engine.generate(second, max_tokens=1)
    assert store.tier("device").usage().blocks == 4
    again = engine.generate(second, max_tokens=1)
    # The most recent prompt's blocks are served from the device pool, the rest from host.
    assert again.trace.hit_blocks_by_tier == {"device": 3}
    # The host tier (4 blocks, LRU) made room for the second prompt by evicting the first's
    # deepest blocks: only the first prompt's head is left there.
    assert engine.counters.get("eviction.host.pressure") == 3
    older = engine.generate(first, max_tokens=1)
    assert older.trace.hit_blocks_by_tier == {"host": 1}


def test_a_new_request_prefills_between_the_decode_steps_of_another(models, make_store):
    # Its first token must not wait for the whole of an answer already being decoded.
    model = models("tiny")
    engine = engine_for(model, make_store(model, ("host",)))
    long_prompt, short_prompt = prompt_of(60, seed=1), prompt_of(40, seed=2)
    expected_long = engine.generate(long_prompt, max_tokens=24, use_cache=False).output_ids
    expected_short = engine.generate(short_prompt, max_tokens=4, use_cache=False).output_ids
    events: list[str] = []
    results: dict[str, list[int]] = {}

    def on_short_token(_token: int) -> bool:
        events.append("short")
        return False

    def run_short() -> None:
        results["short"] = engine.generate(
            short_prompt, max_tokens=4, on_token=on_short_token, use_cache=False
        ).output_ids

    second = threading.Thread(target=run_short)

    def on_long_token(_token: int) -> bool:
        events.append("long")
        if len(events) == 1:  # after the long request's first token: the short one arrives
            second.start()
            while engine._turns.waiting()["prefill"] == 0 and second.is_alive():
                threading.Event().wait(0.001)
        return False

    results["long"] = engine.generate(long_prompt, max_tokens=24, on_token=on_long_token, use_cache=False).output_ids
    second.join()
    assert results == {"long": expected_long, "short": expected_short}
    # The short request's first token came right after the long one's first, not after its 24th.
    assert events[:2] == ["long", "short"]
    assert events.count("long") == 24 and events.count("short") == 4


def test_turns_go_to_the_most_urgent_waiting_step():
    from worker.dataplane.engine.turns import Step, Turns

    turns = Turns()
    order: list[str] = []

    def wait_for(step: Step) -> threading.Thread:
        def take() -> None:
            with turns.hold(step):
                order.append(step.name)

        thread = threading.Thread(target=take)
        thread.start()
        while turns.waiting()[step.name.lower()] == 0:
            threading.Event().wait(0.001)
        return thread

    with turns.hold(Step.DECODE):
        waiters = [wait_for(Step.WRITE_BACK), wait_for(Step.DECODE), wait_for(Step.PREFILL)]
    for thread in waiters:
        thread.join()
    assert order == ["WRITE_BACK", "PREFILL", "DECODE"]


@pytest.mark.parametrize(("length", "passes"), [(203, [192, 11]), (208, [207, 1]), (9, [9])])
def test_a_cold_prompt_is_prefilled_as_its_full_blocks_then_the_rest(models, make_store, length, passes):
    model = models("tiny", "float32")
    engine = engine_for(model, make_store(model, ("device",)))
    seen = []
    forward = model.model.forward

    def spy(*args, **kwargs):
        seen.append(int(kwargs["input_ids"].shape[1]))
        return forward(*args, **kwargs)

    model.model.forward = spy
    try:
        engine.generate(prompt_of(length, seed=4), max_tokens=1, use_cache=False)
    finally:
        del model.model.forward
    assert seen == passes
