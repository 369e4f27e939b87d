"""The offload manager tells whoever watches its copies (vLLM's KV events) of each block it stores at
write-back, each copy its full tier evicts, and each copy dropped as corrupt; nobody watching
costs nothing (real host tier)."""

from __future__ import annotations

from tests.eviction.test_local import key, manager, write
from worker.dataplane.connectors.vllm.kv_events import REMOVED, STORED, TierChanges
from worker.dataplane.errors import BlockCorrupt


def test_stores_evictions_and_quarantines_are_told_in_order(models, make_store):
    model = models("tiny")
    store = make_store(model, ("host",), blocks=4)
    mgr = manager(store, model)
    changes = TierChanges()
    mgr.copies = changes
    assert all(write(mgr, ["a", "b", "c", "d"]))
    assert changes.take() == [(STORED, "host", key(n)) for n in "abcd"]
    assert all(write(mgr, ["e"]))  # the tier is full: one block leaves for it
    told = changes.take()
    assert len(told) == 2 and told[-1] == (STORED, "host", key("e"))
    action, tier, evicted = told[0]
    assert (action, tier) == (REMOVED, "host") and evicted in {key(n) for n in "abcd"}
    assert mgr.counters.get("eviction.host.pressure") == 1 and mgr.counters.get("write_back.host.stored") == 5

    assert mgr.quarantine(key("e"), BlockCorrupt(key("e"), tier="host", reason="checksum"), "a") == ["host"]
    assert changes.take() == [(REMOVED, "host", key("e"))]


def test_nobody_watching_is_told_nothing(models, make_store):
    model = models("tiny")
    store = make_store(model, ("host",), blocks=2)
    mgr = manager(store, model)
    assert mgr.copies is None
    assert all(write(mgr, ["a", "b"])) and all(write(mgr, ["c"]))
    assert mgr.counters.get("eviction.host.pressure") == 1
