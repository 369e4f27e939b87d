"""Which errors a movement task retries, which mean a fence held, and the node without a store."""

from __future__ import annotations

from django.db import InterfaceError, OperationalError

from controlplane.node_api import InvalidTransition, PlacementNotFound, StaleEpoch
from worker.dataplane.errors import TierUnavailable

TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    OperationalError,
    InterfaceError,
    TierUnavailable,
    ConnectionError,
    TimeoutError,
)
"""Errors after which the same task may succeed later (database or Redis away): the task retries."""

FENCED = (StaleEpoch, InvalidTransition, PlacementNotFound)
"""Refusals of a directory change by its epoch or state: someone else changed the copy first."""


class NoStore(RuntimeError):
    """The node serves no model, so it has no tiered store to move bytes with."""
