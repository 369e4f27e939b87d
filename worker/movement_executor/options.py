"""How the node executes movements: the movement rows of the node's typed option table."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from worker.dataplane.config import NodeConfig, load_config
from worker.dataplane.config_values import FAULT_POINTS, VERIFY_MODES

__all__ = ["FAULT_POINTS", "VERIFY_MODES", "MovementOptions"]


@dataclasses.dataclass(frozen=True)
class MovementOptions:
    """How the node executes movements (options `move_verify`, `fault_point`, `fault_hold_s`,
    `reconcile_grace_s` of `worker.dataplane.config`, validated there)."""

    verify: str = "full"
    """full: read the target copy back and verify every byte before the flip; header: compare the
    checksum the target tier stored with the source's (every later read still verifies bytes)."""
    fault_point: str = ""
    fault_hold_s: float = 3600.0
    reconcile_grace_s: float = 300.0
    """Bytes without a placement are deleted only when a reconcile at least this long ago saw
    them orphaned too: an engine's write-back registers its blocks a moment after writing them."""
    scrub_batch: int = 64

    @classmethod
    def from_config(cls, config: NodeConfig) -> MovementOptions:
        return cls(
            verify=config.move_verify,
            fault_point=config.fault_point,
            fault_hold_s=config.fault_hold_s,
            reconcile_grace_s=config.reconcile_grace_s,
        )

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> MovementOptions:
        """The options a node configuration loaded from `environ` (default: the process's
        variables, and the YAML file STRATA_CONFIG_FILE names) holds; ConfigError, a ValueError
        naming the variable, for a bad value."""
        return cls.from_config(load_config(environ=environ))
