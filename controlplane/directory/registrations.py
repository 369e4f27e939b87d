"""The one writer of registrations (blocks and their READY copies) and of by-key placement changes.

Both the control plane's services (`blocks_register`, `placements_change`, on Django's connection)
and the node's directory client (`worker.postgres_directory`, on its own psycopg connection) write through
these functions, so a registration or a change means the same statements whoever sends it. The
callers differ only in what they do around them: the services refuse a batch that names an
unknown namespace, model or node; the node keeps such registrations and retries them later.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any, TypeVar

from controlplane.directory import queries
from controlplane.directory.errors import DirectoryError
from worker.dataplane.directory import BlockRegistration, PlacementChange

T = TypeVar("T")
K = TypeVar("K")


def runs(items: Iterable[T], key: Callable[[T], K]) -> list[tuple[K, list[T]]]:
    """Consecutive items of one key, in order: one statement per run, and an item never overtakes
    one of another key that came before it."""
    return [(k, list(group)) for k, group in itertools.groupby(items, key=key)]


@dataclasses.dataclass(frozen=True, slots=True)
class RegistrationsWritten:
    """What `registrations_write` did with a batch."""

    counts: queries.RegisterCounts
    """New blocks, and copies created or changed."""
    written: int
    """Registrations written (the batch less the rejected ones)."""
    rejected: list[tuple[int, DirectoryError]]
    """Registrations not written (index in the batch, why): they name an unknown namespace, model or node."""


def registrations_write(
    cursor: Any, *, registrations: Sequence[BlockRegistration], now: datetime, all_or_nothing: bool
) -> RegistrationsWritten:
    """Record blocks and one READY copy of each (an upsert in key order: idempotent, and safe when
    two writers register the same blocks at once; an identical copy is left untouched). A
    registration naming an unknown namespace, model or node is not written: with `all_or_nothing`
    the first such one raises its DirectoryError before anything is written; otherwise the others
    are written and the rejected ones come back. Run it inside the caller's transaction."""
    if not registrations:
        return RegistrationsWritten(counts=queries.RegisterCounts(blocks=0, placements=0), written=0, rejected=[])
    scope = queries.resolve(
        cursor,
        namespaces=[r.namespace for r in registrations],
        model_keys=[r.model_key for r in registrations],
        nodes=[r.node for r in registrations if r.node],
    )
    rows, rejected = queries.registration_rows(scope, registrations)
    if rejected and all_or_nothing:
        raise rejected[0][1]
    counts = queries.register(cursor, rows=rows, now=now)
    return RegistrationsWritten(counts=counts, written=len(rows), rejected=rejected)


def placement_changes_write(cursor: Any, *, changes: Sequence[PlacementChange], now: datetime) -> int:
    """Apply by-key changes in order (consecutive changes of one action in one statement); changes
    whose copy is missing or whose epoch moved on are skipped. Returns how many copies changed."""
    changed = 0
    for action, run in runs(changes, key=lambda c: c.action):
        change_rows = [
            queries.ChangeRow(
                namespace=c.namespace,
                model_key=c.model_key,
                prefix_key=c.prefix_key,
                tier=c.tier,
                node=c.node,
                expected_epoch=c.expected_epoch,
            )
            for c in run
        ]
        changed += queries.placements_change(cursor, rows=change_rows, action=action, now=now)
    return changed
