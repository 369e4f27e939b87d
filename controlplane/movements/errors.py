"""Typed errors of the movements services; each names the input it is about."""

from __future__ import annotations

from controlplane.directory.errors import DirectoryError


class MovementError(DirectoryError):
    """A movements request that cannot be done as asked; `field` names the input at fault (the
    API turns it into a 400 like every directory error)."""
