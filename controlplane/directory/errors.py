"""Typed errors of the directory's services and selectors; each names the input it is about."""

from __future__ import annotations


class DirectoryError(ValueError):
    """A directory request that cannot be done as asked; `field` names the input at fault."""

    field = "non_field_errors"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        if field is not None:
            self.field = field


class UnknownNamespace(DirectoryError):
    field = "namespace"


class UnknownModel(DirectoryError):
    field = "model"


class UnknownNode(DirectoryError):
    field = "node"


class PlacementNotFound(DirectoryError):
    field = "placement"


class InvalidTransition(DirectoryError):
    """The placement is not in a state this change may start from (e.g. flipping a READY target)."""

    field = "state"


class StaleEpoch(DirectoryError):
    """The caller acted on an older version of the placement; someone else changed it since."""

    field = "epoch"

    def __init__(self, *, placement_id: int, expected: int, actual: int) -> None:
        self.placement_id = placement_id
        self.expected = expected
        self.actual = actual
        super().__init__(f"placement {placement_id} is at epoch {actual}, not {expected}: it changed since it was read")


class InUse(DirectoryError):
    """An object cannot be deleted while blocks still refer to it (purge them first)."""
