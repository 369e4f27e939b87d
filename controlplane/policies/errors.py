"""Typed errors of the policies app's services and selectors; each names the input it is about."""

from __future__ import annotations


class PolicyError(ValueError):
    """A policy change that cannot be made as asked; `field` names the input at fault (for a
    mode's overrides a path such as ``overrides.tiers[0].low_watermark``)."""

    field = "non_field_errors"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        if field is not None:
            self.field = field


class InUse(PolicyError):
    """An object cannot be deleted in its current role (the default class, the active mode)."""
