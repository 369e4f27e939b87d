"""Fault injection for tests: movements hold at a named step so a test can kill or stop the worker.

With the option `fault_point` (STRATA_FAULT_POINT) set to after-reserve, after-copy or after-flip,
every batch of movements reaching that step logs "fault injection: ..." and sleeps
`fault_hold_s` seconds (STRATA_FAULT_HOLD_S, default 3600), so a test can SIGKILL or SIGSTOP the
real process there. Unset, it does nothing.
"""

from __future__ import annotations

import logging
import os
import time

from controlplane.node_api import MovementRecord
from worker.dataplane.config_values import FAULT_POINTS

__all__ = ["FAULT_POINTS", "FaultInjector"]

log = logging.getLogger("strata.movements")


class FaultInjector:
    """Holds the movements of a batch at the armed fault point (one sleep for the batch)."""

    def __init__(self, *, node: str, point: str, hold_s: float) -> None:
        self.point = point
        self.hold_s = hold_s
        if point:
            log.warning("fault injection armed: movements on node %s will hold at %s (STRATA_FAULT_POINT)", node, point)

    def hold(self, point: str, *movements: MovementRecord) -> None:
        if self.point != point or not movements:
            return
        for movement in movements:
            log.warning(
                "fault injection: movement %d (block %d) held at %s for %.0f s; pid %d",
                movement.id,
                movement.block_id,
                point,
                self.hold_s,
                os.getpid(),
            )
        time.sleep(self.hold_s)
        for movement in movements:
            log.warning("fault injection: movement %d resumes after %s", movement.id, point)
