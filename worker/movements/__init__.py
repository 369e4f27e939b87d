"""The node's side of movements: the executor that fences moves, evictions and warm-ups against the
directory (`executor`), scrub (`scrub`), reconcile (`reconcile`), fault injection for tests
(`faults`) and the dashboard's counts (`announcer`); `records` holds what the executor carries
between its steps. The bytes move in `worker.dataplane.mover`."""

from worker.movements.announcer import MovementAnnouncer
from worker.movements.errors import FENCED, TRANSIENT_ERRORS, NoStore
from worker.movements.executor import WAVE_BYTES, MovementExecutor, executor_for
from worker.movements.faults import FAULT_POINTS, FaultInjector
from worker.movements.options import VERIFY_MODES, MovementOptions
from worker.movements.reconcile import Reconciler, ReconcileReport
from worker.movements.records import Outcome
from worker.movements.scrub import ScrubReport, scrub_tier

__all__ = [
    "FAULT_POINTS",
    "FENCED",
    "TRANSIENT_ERRORS",
    "VERIFY_MODES",
    "WAVE_BYTES",
    "FaultInjector",
    "MovementAnnouncer",
    "MovementExecutor",
    "MovementOptions",
    "NoStore",
    "Outcome",
    "ReconcileReport",
    "Reconciler",
    "ScrubReport",
    "executor_for",
    "scrub_tier",
]
