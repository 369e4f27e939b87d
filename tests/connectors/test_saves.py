"""The save queue: work runs on its thread in the order handed over, within its byte budget, an
error in one piece of work is logged and the next still runs, and closing finishes what it holds."""

from __future__ import annotations

import logging
import re
import threading

import pytest

from worker.dataplane.connectors.saves import SaveQueue


def test_work_runs_in_the_order_it_was_handed_over():
    queue = SaveQueue(budget=100)
    done: list[int] = []
    gate = threading.Event()
    assert queue.reserve(10)
    queue.submit(lambda: (gate.wait(30), done.append(0)), 10)
    for i in range(1, 5):
        assert queue.reserve(10)
        queue.submit(lambda i=i: done.append(i), 10)
    assert queue.pending == 5 and queue.held == 50
    gate.set()
    assert queue.drain(timeout=30)
    assert done == [0, 1, 2, 3, 4]
    assert queue.held == 0 and queue.pending == 0
    queue.close(timeout=30)


def test_a_reservation_past_the_budget_is_refused_until_work_frees_it():
    queue = SaveQueue(budget=30)
    gate = threading.Event()
    assert queue.reserve(20)
    queue.submit(lambda: gate.wait(30), 20)
    assert not queue.reserve(20)  # 20 held: 40 > 30
    assert queue.reserve(10)
    queue.cancel(10)  # a copy that failed gives its bytes back
    assert queue.held == 20
    gate.set()
    assert queue.drain(timeout=30)
    assert queue.reserve(30)
    queue.cancel(30)
    queue.close(timeout=30)


def test_a_budget_of_nothing_refuses_every_reservation():
    queue = SaveQueue(budget=0)
    assert not queue.reserve(1)
    assert queue.drain(timeout=1)


def test_an_error_in_one_piece_of_work_is_logged_and_the_next_runs(caplog):
    queue = SaveQueue(budget=10, name="saves-under-test")
    done: list[str] = []

    def failing() -> None:
        raise OSError("tier went away")

    assert queue.reserve(5)
    queue.submit(failing, 5)
    assert queue.reserve(5)
    queue.submit(lambda: done.append("next"), 5)
    with caplog.at_level(logging.ERROR, logger="strata.vllm"):
        assert queue.drain(timeout=30)
    assert done == ["next"]
    assert queue.held == 0
    assert any(
        "saves-under-test: blocks handed over to be stored were not" in r.message and r.exc_info for r in caplog.records
    )
    queue.close(timeout=30)


def test_closing_finishes_what_was_handed_over_then_takes_nothing_more():
    queue = SaveQueue(budget=10)
    done: list[int] = []
    gate = threading.Event()
    assert queue.reserve(5)
    queue.submit(lambda: (gate.wait(30), done.append(1)), 5)
    threading.Timer(0.1, gate.set).start()
    assert queue.close(timeout=30)
    assert done == [1]
    assert not queue.reserve(1)
    with pytest.raises(RuntimeError, match="closed, the work was not run"):
        queue.submit(lambda: None, 0)


def test_closing_past_its_timeout_says_so(caplog):
    queue = SaveQueue(budget=10, name="stuck-saves")
    gate = threading.Event()
    assert queue.reserve(5)
    queue.submit(lambda: gate.wait(30), 5)
    with caplog.at_level(logging.WARNING, logger="strata.vllm"):
        assert not queue.close(timeout=0.1)
    assert any("stuck-saves: 1 saves still running at shutdown were abandoned" in r.message for r in caplog.records)
    gate.set()


def test_holding_waits_for_room_and_is_never_refused(caplog):
    queue = SaveQueue(budget=30, name="held-saves")
    gate = threading.Event()
    queue.hold(20)
    queue.submit(lambda: gate.wait(30), 20)
    threading.Timer(0.1, gate.set).start()
    queue.hold(20)  # waits until the first work frees its 20 bytes
    assert queue.held == 20
    queue.cancel(20)
    queue.hold(100)  # larger than the whole budget: taken when nothing else is held
    assert queue.held == 100
    with caplog.at_level(logging.WARNING, logger="strata.vllm"):
        queue.hold(10, timeout=0.05)  # no room by the timeout: held all the same, and said
    assert queue.held == 110
    assert any("held-saves: 110 bytes over its budget of 30 bytes" in r.message for r in caplog.records)
    queue.cancel(110)
    queue.close(timeout=30)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("save_staging_bytes", "-1", "--save-staging-bytes: expected a size such as 512MiB or 2GB, got '-1'"),
        ("lookup_deadline_seconds", "0", "--lookup-deadline-seconds: must be greater than zero, got '0'"),
    ],
)
def test_a_bad_save_budget_or_lookup_deadline_is_refused_by_name(option, value, message):
    from worker.dataplane.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(overrides={option: value}, environ={})
