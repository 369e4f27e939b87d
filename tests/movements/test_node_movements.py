"""Movements executed by REAL node processes (`manage.py strata_node --model tiny`) through the
real broker, and the faults the issue lists: SIGKILL after the copy and after the flip, SIGSTOP
past the visibility timeout. After each, the invariants I1-I4 are checked against the bytes."""

from __future__ import annotations

import os
import signal
import time

import pytest

from controlplane.directory.choices import PlacementState
from controlplane.directory.models import Block, Placement
from controlplane.movements.choices import MovementState
from controlplane.movements.models import Movement
from controlplane.movements.services import movements_plan
from tests.movements.invariants import invariants_check
from tests.movements.procs import (
    DRAIN_HOST,
    NodeProcesses,
    blocks_of,
    reconcile_and_check,
    write_blocks,
)
from tests.movements.procs import state_of as _state_of
from tests.support import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]


@pytest.fixture
def nodes(node_factory) -> NodeProcesses:  # type: ignore[no-untyped-def]
    return node_factory()


def _write_blocks(store, profile, node: str, count: int) -> list[Block]:  # type: ignore[no-untyped-def]
    return blocks_of(write_blocks(store, profile, node, count))


def _check_after(store, node: str) -> None:  # type: ignore[no-untyped-def]
    """Reconcile (grace 0: every node process is gone or idle), then I1-I4 must hold."""
    assert reconcile_and_check({node: store}, tiers=("host", "disk")).checked > 0


def test_a_real_node_executes_a_planned_move_through_the_broker(nodes):
    process, log = nodes.start()
    nodes.wait_up(process)
    store, profile = nodes.config_store()
    try:
        blocks = _write_blocks(store, profile, nodes.name, 4)
        result = movements_plan(snapshot=DRAIN_HOST, node=nodes.name, reason="manual")
        assert len(result.written) == 4
        wait_for(
            lambda: all(_state_of(i) == MovementState.DONE for i in result.written),
            timeout=60,
            what="the node to execute the moves",
        )
        for block in blocks:
            [copy] = Placement.objects.filter(block=block)
            assert (copy.tier, copy.node.name, copy.state) == ("disk", nodes.name, PlacementState.READY)
        assert all(
            m.bytes == store.layout.block_bytes and m.attempts == 1
            for m in Movement.objects.filter(id__in=result.written)
        )
        assert "host->disk): done" in log.read_text()
        _check_after(store, nodes.name)
    finally:
        store.close()


@pytest.mark.parametrize("point", ["after-copy", "after-flip"])
def test_sigkill_mid_move_then_a_new_worker_finishes_it(nodes, point):
    victim, victim_log = nodes.start(STRATA_FAULT_POINT=point)
    nodes.wait_up(victim)
    store, profile = nodes.config_store()
    try:
        [block] = _write_blocks(store, profile, nodes.name, 1)
        result = movements_plan(snapshot=DRAIN_HOST, node=nodes.name, reason="manual")
        [ident] = result.written
        wait_for(lambda: f"held at {point}" in victim_log.read_text(), timeout=60, what=f"the worker to reach {point}")
        victim.kill()
        victim.wait(10)
        # Killed between copy and flip the old copy is still the served one; between flip and free
        # the new one is. Either way exactly one READY copy, and its bytes are good.
        ready = list(Placement.objects.filter(block=block, state=PlacementState.READY).values_list("tier", flat=True))
        assert ready == (["host"] if point == "after-copy" else ["disk"])
        assert invariants_check(stores={nodes.name: store}, orphans=False).violations == []
        _, log = nodes.start()  # same node, no fault: the broker delivers the unacked message again
        wait_for(lambda: _state_of(ident) == MovementState.DONE, timeout=90, what="the redelivered move")
        assert list(Placement.objects.filter(block=block).values_list("tier", "state")) == [("disk", "ready")]
        assert Movement.objects.get(id=ident).attempts == 2
        _check_after(store, nodes.name)
    finally:
        store.close()


def test_sigstop_past_the_visibility_timeout_the_late_flip_is_refused(nodes):
    stopped, stopped_log = nodes.start(STRATA_FAULT_POINT="after-copy", STRATA_FAULT_HOLD_S="2")
    nodes.wait_up(stopped)
    store, profile = nodes.config_store()
    try:
        [block] = _write_blocks(store, profile, nodes.name, 1)
        [ident] = movements_plan(snapshot=DRAIN_HOST, node=nodes.name, reason="manual").written
        wait_for(lambda: "held at after-copy" in stopped_log.read_text(), timeout=60, what="the worker to hold")
        os.kill(stopped.pid, signal.SIGSTOP)
        _, log = nodes.start()
        wait_for(lambda: _state_of(ident) == MovementState.DONE, timeout=90, what="the other worker to take over")
        os.kill(stopped.pid, signal.SIGCONT)
        wait_for(lambda: "flip refused" in stopped_log.read_text(), timeout=60, what="the late worker's refused flip")
        time.sleep(1)
        assert list(Placement.objects.filter(block=block).values_list("tier", "state")) == [("disk", "ready")]
        assert Movement.objects.get(id=ident).state == MovementState.DONE
        _check_after(store, nodes.name)
    finally:
        store.close()
