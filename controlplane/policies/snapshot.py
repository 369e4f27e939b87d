"""The policies in force, as plain frozen data: what the planner, the dry-run and the nodes read.

`policies_snapshot()` reads the current version from the database; `overrides` lets a dry-run ask
"what if" without saving anything. The specs themselves live in `specs` (re-exported here).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from controlplane.policies.selectors import snapshot_current
from controlplane.policies.specs import (
    ALGORITHMS,
    DEFAULT_CLASS,
    PolicySnapshot,
    PriorityClassSpec,
    TierPolicySpec,
)

__all__ = ["ALGORITHMS", "DEFAULT_CLASS", "PolicySnapshot", "PriorityClassSpec", "TierPolicySpec", "policies_snapshot"]


def policies_snapshot(*, overrides: Mapping[str, Any] | None = None) -> PolicySnapshot:
    """The policies in force now (with a mode's overrides applied), or with `overrides` applied
    on top for a dry-run."""
    return snapshot_current(overrides=overrides)
