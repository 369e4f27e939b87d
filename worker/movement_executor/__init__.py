"""The node's side of movements: the executor that fences moves, evictions and warm-ups against the
directory (`executor`), scrub (`scrub`), reconcile (`reconcile`), fault injection for tests
(`faults`), the quarantine of a copy that failed a check (`copies`) and the dashboard's counts
(`announcer`); `records` holds what the executor carries between its steps. The bytes move in
`worker.dataplane.mover`; every read and write of the control plane's data goes through
`controlplane.node_api`."""

from worker.movement_executor.announcer import MovementAnnouncer
from worker.movement_executor.errors import FENCED, TRANSIENT_ERRORS, NoStore
from worker.movement_executor.executor import WAVE_BYTES, MovementExecutor, executor_for
from worker.movement_executor.faults import FAULT_POINTS, FaultInjector
from worker.movement_executor.options import VERIFY_MODES, MovementOptions
from worker.movement_executor.reconcile import Reconciler, ReconcileReport
from worker.movement_executor.records import Outcome
from worker.movement_executor.scrub import ScrubReport, scrub_tier

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
