"""The directory's hot SQL, one statement per round trip, runnable on any DB-API cursor.

Selectors and services run these on Django's connection; the node's write-behind Directory
(worker.postgres_directory) runs them on its own psycopg connections, so both paths share one text.
Arrays travel as single parameters (unnest ... WITH ORDINALITY), which keeps a 4096-key lookup
to one statement with one plan. No literal percent signs: Django's cursor formats client-side.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, NamedTuple

from controlplane.directory.choices import TIER_ORDER, PlacementState, TierLevel
from controlplane.directory.errors import DirectoryError, UnknownModel, UnknownNamespace, UnknownNode
from worker.dataplane.directory import BlockLocation, BlockRegistration, LookupResult

BLOCK_TABLE = "directory_block"
PLACEMENT_TABLE = "directory_placement"
NAMESPACE_TABLE = "directory_namespace"
MODEL_TABLE = "directory_modelprofile"
NODE_TABLE = "directory_node"


# Arrays travel as one array literal each. Handing psycopg a list makes it adapt every element in
# Python, which for a 4096-row registration costs more than the statement itself.
def uuids(values: Iterable[uuid.UUID]) -> str:
    """A uuid[] literal."""
    return "{" + ",".join(v.hex if isinstance(v, uuid.UUID) else uuid.UUID(str(v)).hex for v in values) + "}"


def ints(values: Iterable[int | None]) -> str:
    """A bigint[] (or integer[]) literal; None is NULL."""
    return "{" + ",".join("NULL" if v is None else str(int(v)) for v in values) + "}"


def floats(values: Iterable[float | None]) -> str:
    """A float8[] literal; None is NULL."""
    return "{" + ",".join("NULL" if v is None else repr(float(v)) for v in values) + "}"


def texts(values: Iterable[str | None]) -> str:
    """A text[] literal, every element quoted; None is NULL."""
    values = list(values)
    if values and None not in values:
        whole = "".join(values)  # type: ignore[arg-type]  # None was ruled out above
        if '"' not in whole and "\\" not in whole:
            # Nothing to escape (tiers, checksums, names): one join.
            return '{"' + '","'.join(values) + '"}'  # type: ignore[arg-type]
    return (
        "{"
        + ",".join("NULL" if v is None else '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values)
        + "}"
    )


def times(values: Iterable[datetime]) -> str:
    """A timestamptz[] literal (aware datetimes)."""
    return "{" + ",".join('"' + v.isoformat() + '"' for v in values) + "}"


_TIER_RANK = " ".join(f"WHEN '{tier}' THEN {rank}" for rank, tier in enumerate(TIER_ORDER))

# One branch per kind of key; each probes one index per key (prefix: the unique
# (prefix_key, namespace, model) index; content: (content_key)), joins the block's few placements
# and keeps the best READY one. A node sees its own local copies and the shared remote tier.
# With the best copy comes the checksum of the block's READY copy in the remote tier, which a
# node must find in any copy it reads from there: the best copy's own when that is the remote
# one, else one more probe of the placements' unique index, made only for the keys whose best
# copy is local (those of the asking node, which asks mostly for what its tiers lack).
_LOOKUP_BRANCH = f"""
    SELECT {{kind}} AS kind, k.ord, best.*,
           CASE WHEN best.tier = '{TierLevel.REMOTE.value}' THEN best.checksum ELSE (
               SELECT r.checksum FROM {PLACEMENT_TABLE} r
               WHERE r.block_id = best.block_id AND r.tier = '{TierLevel.REMOTE.value}' AND r.node_id IS NULL
                 AND r.state = '{PlacementState.READY.value}'
           ) END AS remote_checksum
    FROM unnest(%({{param}})s::uuid[]) WITH ORDINALITY AS k(key, ord)
    CROSS JOIN LATERAL (
        SELECT b.id AS block_id, b.prefix_key, b.content_key, b.position, b.token_count,
               p.id AS placement_id, p.tier, p.node_id, p.locator, p."offset", p.size_bytes,
               p.checksum, p.epoch
        FROM {BLOCK_TABLE} b
        JOIN {PLACEMENT_TABLE} p ON p.block_id = b.id
        WHERE b.{{column}} = k.key
          AND (%(any_namespace)s OR b.namespace_id = ANY(s.namespace_ids))
          AND (%(any_model)s OR b.model_id = s.model_id)
          AND p.state = '{PlacementState.READY.value}'
          AND (%(any_node)s OR p.node_id IS NULL OR p.node_id = s.node_id)
        ORDER BY CASE p.tier {_TIER_RANK} ELSE {len(TIER_ORDER)} END, p.id
        LIMIT 1
    ) AS best
"""

LOOKUP_SQL = f"""
WITH s AS (
    SELECT
        (SELECT id FROM {NAMESPACE_TABLE} WHERE name = %(namespace)s) AS namespace_id,
        ARRAY(SELECT id FROM {NAMESPACE_TABLE} WHERE name = %(namespace)s OR shared) AS namespace_ids,
        (SELECT id FROM {MODEL_TABLE} WHERE model_key = %(model_key)s) AS model_id,
        (SELECT id FROM {NODE_TABLE} WHERE name = %(node)s) AS node_id
)
SELECT s.namespace_id, s.model_id, s.node_id, h.kind, h.ord, h.block_id, h.prefix_key, h.content_key,
       h.position, h.token_count, h.placement_id, h.tier, n.name, h.locator, h."offset", h.size_bytes,
       h.checksum, h.epoch, h.remote_checksum
FROM s
LEFT JOIN LATERAL (
    {_LOOKUP_BRANCH.format(kind=0, param="prefix_keys", column="prefix_key")}
    UNION ALL
    {_LOOKUP_BRANCH.format(kind=1, param="content_keys", column="content_key")}
) AS h ON true
LEFT JOIN {NODE_TABLE} n ON n.id = h.node_id
"""


@dataclasses.dataclass(frozen=True, slots=True)
class LookupAnswer:
    """What one lookup statement returns: the scope it resolved and the hits, as rows of
    (kind: 0 prefix / 1 content, 1-based index of the key asked, block id, prefix key, content key,
    position, token count, placement id, tier, node name, locator, offset, size, checksum, epoch,
    checksum of the READY remote copy or None)."""

    namespace_id: int | None
    model_id: int | None
    node_id: int | None
    rows: list[tuple[Any, ...]]


def lookup_params(
    *,
    namespace: str | None,
    model_key: uuid.UUID | None,
    node: str | None,
    prefix_keys: Sequence[uuid.UUID],
    content_keys: Sequence[uuid.UUID] = (),
) -> dict[str, Any]:
    """The parameters of LOOKUP_SQL (also for EXPLAIN in tests and the benchmark)."""
    return {
        "namespace": namespace,
        "model_key": model_key,
        "node": node,
        "any_namespace": namespace is None,
        "any_model": model_key is None,
        "any_node": node is None,
        "prefix_keys": uuids(prefix_keys),
        "content_keys": uuids(content_keys),
    }


def lookup(
    cursor: Any,
    *,
    namespace: str | None,
    model_key: uuid.UUID | None,
    node: str | None,
    prefix_keys: Sequence[uuid.UUID],
    content_keys: Sequence[uuid.UUID] = (),
) -> LookupAnswer:
    """Run the lookup statement once. None for namespace/model/node means "any"."""
    cursor.execute(
        LOOKUP_SQL,
        lookup_params(
            namespace=namespace, model_key=model_key, node=node, prefix_keys=prefix_keys, content_keys=content_keys
        ),
    )
    records = cursor.fetchall()
    first = records[0]
    # Rows are kept as tuples: a 4096-key answer is turned into the caller's objects once, not twice.
    rows = [r[3:] for r in records if r[3] is not None]
    return LookupAnswer(namespace_id=first[0], model_id=first[1], node_id=first[2], rows=rows)


RESOLVE_SQL = f"""
SELECT 'namespace', name, id::text FROM {NAMESPACE_TABLE} WHERE name = ANY(%(namespaces)s::text[])
UNION ALL
SELECT 'model', model_key::text, id::text FROM {MODEL_TABLE} WHERE model_key = ANY(%(model_keys)s::uuid[])
UNION ALL
SELECT 'node', name, id::text FROM {NODE_TABLE} WHERE name = ANY(%(nodes)s::text[])
"""


@dataclasses.dataclass(frozen=True, slots=True)
class Scope:
    """Ids of the namespaces, model profiles and nodes a batch names (unknown names are absent)."""

    namespaces: dict[str, int]
    models: dict[uuid.UUID, int]
    nodes: dict[str, int]


def resolve(cursor: Any, *, namespaces: Iterable[str], model_keys: Iterable[uuid.UUID], nodes: Iterable[str]) -> Scope:
    """Map names and model keys to ids in one round trip."""
    cursor.execute(
        RESOLVE_SQL,
        {
            "namespaces": texts(sorted(set(namespaces))),
            "model_keys": uuids(sorted(set(model_keys))),
            "nodes": texts(sorted(set(nodes))),
        },
    )
    scope = Scope(namespaces={}, models={}, nodes={})
    for kind, name, ident in cursor.fetchall():
        if kind == "namespace":
            scope.namespaces[name] = int(ident)
        elif kind == "model":
            scope.models[uuid.UUID(name)] = int(ident)
        else:
            scope.nodes[name] = int(ident)
    return scope


class RegisterRow(NamedTuple):
    """One block and one READY copy of it, with every reference already resolved to an id.

    A tuple, so a batch of them turns into columns in one step (`zip(*rows)`)."""

    namespace_id: int
    model_id: int
    prefix_key: uuid.UUID
    content_key: uuid.UUID
    position: int
    token_count: int
    size_bytes: int
    priority: str
    tier: str
    node_id: int | None
    locator: str
    offset: int
    checksum: str


# Sorted input keeps every registration taking row locks in the same order: two processes
# registering the same blocks wait for each other instead of deadlocking. The blocks that were
# new come back with their ids, so their copies need no lookup and no conflict check.
REGISTER_BLOCKS_SQL = f"""
INSERT INTO {BLOCK_TABLE} (namespace_id, model_id, prefix_key, content_key, position, token_count,
                           size_bytes, priority, created_at, last_access_at, access_count)
SELECT r.namespace_id, r.model_id, r.prefix_key, r.content_key, r.position, r.token_count, r.size_bytes,
       r.priority, %(now)s, %(now)s, 0
FROM unnest(%(namespace_ids)s::bigint[], %(model_ids)s::bigint[], %(prefix_keys)s::uuid[],
            %(content_keys)s::uuid[], %(positions)s::bigint[], %(token_counts)s::integer[],
            %(sizes)s::bigint[], %(priorities)s::text[])
     AS r(namespace_id, model_id, prefix_key, content_key, position, token_count, size_bytes, priority)
ORDER BY r.prefix_key, r.namespace_id, r.model_id
ON CONFLICT (prefix_key, namespace_id, model_id) DO NOTHING
RETURNING id, prefix_key, namespace_id, model_id
"""

# The copies of the blocks REGISTER_BLOCKS_SQL created (`new_block_ids`, by row; NULL for the
# others): nobody else can have a copy of a block that is not committed yet, so a plain insert
# (no speculative insertion and its confirmation record, no probe of the block's key). The last
# copy named in a batch wins.
REGISTER_NEW_PLACEMENTS_SQL = f"""
INSERT INTO {PLACEMENT_TABLE} (block_id, tier, node_id, locator, "offset", size_bytes, checksum, state, epoch,
                               updated_at)
SELECT DISTINCT ON (r.block_id, r.tier, r.node_id)
       r.block_id, r.tier, r.node_id, r.locator, r."offset", r.size_bytes, r.checksum,
       '{PlacementState.READY.value}', 1, %(now)s
FROM unnest(%(new_block_ids)s::bigint[], %(tiers)s::text[], %(node_ids)s::bigint[], %(locators)s::text[],
            %(offsets)s::bigint[], %(sizes)s::bigint[], %(checksums)s::text[])
     WITH ORDINALITY AS r(block_id, tier, node_id, locator, "offset", size_bytes, checksum, ord)
WHERE r.block_id IS NOT NULL
ORDER BY r.block_id, r.tier, r.node_id, r.ord DESC
"""

# The copies of the other rows' blocks, which existed before (re-registrations, a second node's
# copy, or a block another process committed while REGISTER_BLOCKS_SQL waited on it). A statement
# of its own, so that it sees those blocks; the last copy named in a batch wins, and
# re-registering the same copy changes nothing (no new row version, no epoch bump): registration
# is idempotent.
REGISTER_PLACEMENTS_SQL = f"""
INSERT INTO {PLACEMENT_TABLE} AS p (block_id, tier, node_id, locator, "offset", size_bytes, checksum,
                                    state, epoch, updated_at)
SELECT DISTINCT ON (b.id, r.tier, r.node_id)
       b.id, r.tier, r.node_id, r.locator, r."offset", r.size_bytes, r.checksum,
       '{PlacementState.READY.value}', 1, %(now)s
FROM unnest(%(namespace_ids)s::bigint[], %(model_ids)s::bigint[], %(prefix_keys)s::uuid[],
            %(tiers)s::text[], %(node_ids)s::bigint[], %(locators)s::text[], %(offsets)s::bigint[],
            %(sizes)s::bigint[], %(checksums)s::text[], %(new_block_ids)s::bigint[])
     WITH ORDINALITY AS r(namespace_id, model_id, prefix_key, tier, node_id, locator, "offset",
                          size_bytes, checksum, new_block_id, ord)
-- LIMIT 1 keeps this a per-row probe of the unique index: as a plain join the planner may
-- hash the whole block table instead.
CROSS JOIN LATERAL (
    SELECT id FROM {BLOCK_TABLE}
    WHERE prefix_key = r.prefix_key AND namespace_id = r.namespace_id AND model_id = r.model_id
    LIMIT 1
) AS b
WHERE r.new_block_id IS NULL
ORDER BY b.id, r.tier, r.node_id, r.ord DESC
ON CONFLICT (block_id, tier, node_id) DO UPDATE
SET locator = EXCLUDED.locator, "offset" = EXCLUDED."offset", size_bytes = EXCLUDED.size_bytes,
    checksum = EXCLUDED.checksum, state = EXCLUDED.state, epoch = p.epoch + 1,
    updated_at = EXCLUDED.updated_at
WHERE (p.locator, p."offset", p.size_bytes, p.checksum, p.state)
      IS DISTINCT FROM (EXCLUDED.locator, EXCLUDED."offset", EXCLUDED.size_bytes, EXCLUDED.checksum,
                        EXCLUDED.state)
"""


@dataclasses.dataclass(frozen=True, slots=True)
class RegisterCounts:
    blocks: int
    """Blocks that were new."""
    placements: int
    """Copies created or changed (identical re-registrations are not counted)."""


def register_params(rows: Sequence[RegisterRow], now: datetime) -> dict[str, Any]:
    """The parameters of the three registration statements (each takes those it names), built
    once; `new_block_ids` (every row's block is new: none) is filled in by `register`."""
    (
        namespace_ids,
        model_ids,
        prefix_keys,
        content_keys,
        positions,
        token_counts,
        sizes,
        priorities,
        tiers,
        node_ids,
        locators,
        offsets,
        checksums,
    ) = zip(*rows, strict=True)
    return {
        "now": now,
        "namespace_ids": ints(namespace_ids),
        "model_ids": ints(model_ids),
        "prefix_keys": uuids(prefix_keys),
        "content_keys": uuids(content_keys),
        "positions": ints(positions),
        "token_counts": ints(token_counts),
        "sizes": ints(sizes),
        "priorities": texts(priorities),
        "tiers": texts(tiers),
        "node_ids": ints(node_ids),
        "locators": texts(locators),
        "offsets": ints(offsets),
        "checksums": texts(checksums),
        "new_block_ids": ints([None] * len(rows)),
    }


def register(cursor: Any, *, rows: Sequence[RegisterRow], now: datetime) -> RegisterCounts:
    """Upsert blocks, then their READY copies: two statements (three when some blocks existed
    before); run them in one transaction."""
    if not rows:
        return RegisterCounts(blocks=0, placements=0)
    params = register_params(rows, now)
    cursor.execute(REGISTER_BLOCKS_SQL, params)
    # Keyed as a row starts: (namespace id, model id, prefix key).
    created = {(namespace_id, model_id, key): block_id for block_id, key, namespace_id, model_id in cursor.fetchall()}
    new_block_ids = [created.get(row[:3]) for row in rows]
    params["new_block_ids"] = ints(new_block_ids)
    placements = 0
    if created:
        cursor.execute(REGISTER_NEW_PLACEMENTS_SQL, params)
        placements += max(cursor.rowcount, 0)
    if None in new_block_ids:
        cursor.execute(REGISTER_PLACEMENTS_SQL, params)
        placements += max(cursor.rowcount, 0)
    return RegisterCounts(blocks=len(created), placements=placements)


# Rows are locked in id order before they are changed, so two nodes touching the same hot blocks
# in different orders queue behind each other instead of deadlocking.
TOUCH_SQL = f"""
WITH t AS (
    SELECT b.id, sum(r.hits) AS hits, max(r.at) AS at
    FROM unnest(%(namespaces)s::text[], %(model_keys)s::uuid[], %(prefix_keys)s::uuid[],
                %(hits)s::bigint[], %(ats)s::timestamptz[]) AS r(namespace, model_key, prefix_key, hits, at)
    JOIN {NAMESPACE_TABLE} ns ON ns.name = r.namespace
    JOIN {MODEL_TABLE} m ON m.model_key = r.model_key
    JOIN {BLOCK_TABLE} b ON b.prefix_key = r.prefix_key AND b.namespace_id = ns.id AND b.model_id = m.id
    GROUP BY b.id
),
locked AS (
    SELECT b.id FROM {BLOCK_TABLE} b JOIN t ON t.id = b.id ORDER BY b.id FOR NO KEY UPDATE OF b
)
UPDATE {BLOCK_TABLE} b
SET access_count = b.access_count + t.hits, last_access_at = GREATEST(b.last_access_at, t.at)
FROM t
WHERE b.id = t.id AND b.id IN (SELECT id FROM locked)
"""


@dataclasses.dataclass(frozen=True, slots=True)
class TouchRow:
    namespace: str
    model_key: uuid.UUID
    prefix_key: uuid.UUID
    hits: int
    at: datetime


def touch_params(rows: Sequence[TouchRow]) -> dict[str, Any]:
    """The parameters of TOUCH_SQL."""
    return {
        "namespaces": texts(r.namespace for r in rows),
        "model_keys": uuids(r.model_key for r in rows),
        "prefix_keys": uuids(r.prefix_key for r in rows),
        "hits": ints(r.hits for r in rows),
        "ats": times(r.at for r in rows),
    }


def touch(cursor: Any, *, rows: Sequence[TouchRow]) -> int:
    """Add accesses to blocks by key (unknown keys are ignored); returns the blocks updated."""
    if not rows:
        return 0
    cursor.execute(TOUCH_SQL, touch_params(rows))
    return max(cursor.rowcount, 0)


# The copies a batch of by-key changes is aimed at, with the epoch each change expects.
_CHANGE_TARGETS = f"""
    SELECT p.id, p.block_id, r.ord
    FROM unnest(%(namespaces)s::text[], %(model_keys)s::uuid[], %(prefix_keys)s::uuid[],
                %(tiers)s::text[], %(nodes)s::text[], %(epochs)s::bigint[])
         WITH ORDINALITY AS r(namespace, model_key, prefix_key, tier, node, epoch, ord)
    JOIN {NAMESPACE_TABLE} ns ON ns.name = r.namespace
    JOIN {MODEL_TABLE} m ON m.model_key = r.model_key
    JOIN {BLOCK_TABLE} b ON b.prefix_key = r.prefix_key AND b.namespace_id = ns.id AND b.model_id = m.id
    LEFT JOIN {NODE_TABLE} nd ON nd.name = r.node
    JOIN {PLACEMENT_TABLE} p ON p.block_id = b.id AND p.tier = r.tier
         AND ((r.tier = '{TierLevel.REMOTE.value}' AND p.node_id IS NULL) OR p.node_id = nd.id)
    WHERE r.epoch IS NULL OR p.epoch = r.epoch
    ORDER BY p.id
"""

CHANGE_STATE_SQL = f"""
WITH target AS ({_CHANGE_TARGETS} FOR NO KEY UPDATE OF p)
UPDATE {PLACEMENT_TABLE} p
SET state = %(state)s, epoch = p.epoch + 1, updated_at = %(now)s
FROM target
WHERE p.id = target.id AND p.state <> %(state)s
"""

CHANGE_DELETE_SQL = f"""
WITH target AS ({_CHANGE_TARGETS} FOR UPDATE OF p)
DELETE FROM {PLACEMENT_TABLE} p USING target WHERE p.id = target.id
"""


@dataclasses.dataclass(frozen=True, slots=True)
class ChangeRow:
    namespace: str
    model_key: uuid.UUID
    prefix_key: uuid.UUID
    tier: str
    node: str | None
    expected_epoch: int | None


def change_params(rows: Sequence[ChangeRow], *, action: str, now: datetime) -> dict[str, Any]:
    """The parameters of CHANGE_STATE_SQL (with the state `action` leads to) or CHANGE_DELETE_SQL."""
    params: dict[str, Any] = {
        "namespaces": texts(r.namespace for r in rows),
        "model_keys": uuids(r.model_key for r in rows),
        "prefix_keys": uuids(r.prefix_key for r in rows),
        "tiers": texts(r.tier for r in rows),
        "nodes": texts(r.node for r in rows),
        "epochs": ints(r.expected_epoch for r in rows),
        "now": now,
    }
    if action != "delete":
        params["state"] = {"corrupt": PlacementState.CORRUPT, "deleting": PlacementState.DELETING}[action].value
    return params


def placements_change(cursor: Any, *, rows: Sequence[ChangeRow], action: str, now: datetime) -> int:
    """Apply one action ('corrupt', 'deleting' or 'delete') to copies named by key; copies that are
    missing or whose epoch moved on are left alone. Returns how many copies changed."""
    if not rows:
        return 0
    params = change_params(rows, action=action, now=now)
    cursor.execute(CHANGE_DELETE_SQL if action == "delete" else CHANGE_STATE_SQL, params)
    return max(cursor.rowcount, 0)


def explain(cursor: Any, sql: str, params: dict[str, Any]) -> str:
    """EXPLAIN (ANALYZE, BUFFERS) of one statement, as text (for tests and the benchmark)."""
    cursor.execute("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + sql, params)
    return "\n".join(row[0] for row in cursor.fetchall())


def registration_rows(
    scope: Scope, registrations: Sequence[BlockRegistration]
) -> tuple[list[RegisterRow], list[tuple[int, DirectoryError]]]:
    """Registrations as rows of ids; those naming an unknown namespace, model or node come back
    separately with the error (by index), so a caller can refuse the batch or count them."""
    rows: list[RegisterRow] = []
    rejected: list[tuple[int, DirectoryError]] = []
    for index, reg in enumerate(registrations):
        namespace_id = scope.namespaces.get(reg.namespace)
        model_id = scope.models.get(reg.model_key)
        node_id = scope.nodes.get(reg.node) if reg.node else None
        if namespace_id is None:
            rejected.append((index, UnknownNamespace(f"namespace: no namespace named {reg.namespace!r}")))
        elif model_id is None:
            rejected.append(
                (index, UnknownModel(f"model_key: no model profile with key {reg.model_key}", field="model_key"))
            )
        elif reg.tier != TierLevel.REMOTE and node_id is None:
            rejected.append(
                (index, UnknownNode(f"node: no node named {reg.node!r} (it registers with its first heartbeat)"))
            )
        else:
            rows.append(
                RegisterRow(
                    namespace_id,
                    model_id,
                    reg.prefix_key,
                    reg.content_key,
                    reg.position,
                    reg.tokens,
                    reg.nbytes,
                    reg.priority,
                    reg.tier,
                    node_id,
                    reg.locator,
                    reg.offset,
                    reg.checksum,
                )
            )
    return rows, rejected


def lookup_result(
    answer: LookupAnswer, *, prefix_keys: Sequence[uuid.UUID], content_keys: Sequence[uuid.UUID]
) -> LookupResult:
    """The data plane's view of a lookup: one location or None per asked key, in order."""
    prefix: list[BlockLocation | None] = [None] * len(prefix_keys)
    content: list[BlockLocation | None] = [None] * len(content_keys)
    for (
        kind,
        ordinal,
        block_id,
        prefix_key,
        content_key,
        position,
        tokens,
        placement_id,
        tier,
        node,
        locator,
        offset,
        nbytes,
        checksum,
        epoch,
        remote_checksum,
    ) in answer.rows:
        index = ordinal - 1
        found, asked = (prefix, prefix_keys) if kind == 0 else (content, content_keys)
        found[index] = BlockLocation(
            key=asked[index],
            prefix_key=prefix_key,
            content_key=content_key,
            position=position,
            tokens=tokens,
            block_id=block_id,
            placement_id=placement_id,
            tier=tier,
            node=node,
            locator=locator,
            offset=offset,
            nbytes=nbytes,
            checksum=checksum,
            epoch=epoch,
            remote_checksum=remote_checksum or "",
        )
    return LookupResult(prefix=tuple(prefix), content=tuple(content))


NAMESPACE_SALT_SQL = f"SELECT salt FROM {NAMESPACE_TABLE} WHERE name = %(name)s"


SHARED_SALTS_SQL = f"SELECT name, salt FROM {NAMESPACE_TABLE} WHERE shared ORDER BY name"


def shared_salts(cursor: Any) -> dict[str, bytes]:
    """The salt of every shared namespace, by name."""
    cursor.execute(SHARED_SALTS_SQL)
    return {name: bytes.fromhex(salt) for name, salt in cursor.fetchall()}


def namespace_salt(cursor: Any, *, name: str) -> bytes:
    """The salt of a namespace as bytes; UnknownNamespace when there is none of that name."""
    cursor.execute(NAMESPACE_SALT_SQL, {"name": name})
    row = cursor.fetchone()
    if row is None:
        raise UnknownNamespace(f"namespace: no namespace named {name!r}")
    return bytes.fromhex(row[0])
