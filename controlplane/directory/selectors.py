"""Directory reads: nodes, namespaces, model profiles, blocks, and the batched hit detection."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from django.conf import settings
from django.db import connection
from django.db.models import Exists, OuterRef, Prefetch, QuerySet

from controlplane.directory import queries
from controlplane.directory.choices import BLOCK_ORDERING_COLUMNS, BlockOrdering
from controlplane.directory.errors import UnknownModel, UnknownNamespace, UnknownNode
from controlplane.directory.models import Block, ModelProfile, Namespace, Node, NodeCredential, Placement
from worker.dataplane.directory import LookupResult

PREPARE_AFTER = 3
"""Executions of one statement on a connection after which psycopg prepares it."""


@contextmanager
def sql_cursor() -> Iterator[Any]:
    """A cursor on Django's connection (its transaction, its query log) that sends parameters
    apart from the SQL text, so that on a connection that runs the lookup again and again
    PostgreSQL stops planning it on every call (planning is most of a 64-key lookup's time)."""
    connection.ensure_connection()
    # Django switches preparing off (a pgbouncer in transaction mode cannot keep prepared
    # statements); its own cursors bind on the client and never prepare, so this only turns it
    # back on for the directory's statements.
    if connection.connection.prepare_threshold is None:
        connection.connection.prepare_threshold = PREPARE_AFTER
    raw = psycopg.Cursor(connection.connection)
    # The stubs type these for Django's own wrapper; any DB-API cursor is what they wrap.
    cursor = (
        connection.make_debug_cursor(raw)  # type: ignore[arg-type]
        if connection.queries_logged
        else connection.make_cursor(raw)  # type: ignore[arg-type]
    )
    with cursor:
        yield cursor


def nodes_list() -> QuerySet[Node]:
    """All nodes with their tiers, in name order (two queries whatever the count)."""
    return Node.objects.prefetch_related("tiers").order_by("name")


def namespaces_list() -> QuerySet[Namespace]:
    return Namespace.objects.order_by("name")


def modelprofiles_list() -> QuerySet[ModelProfile]:
    return ModelProfile.objects.order_by("name")


def blocks_lookup(
    *,
    namespace: str | None,
    model_key: uuid.UUID | None,
    node: str | None,
    prefix_keys: Sequence[uuid.UUID],
    content_keys: Sequence[uuid.UUID] = (),
    strict: bool = False,
) -> LookupResult:
    """Each key's best READY copy for `node` (its device, host, disk, then remote), in ONE query.

    Only blocks of `namespace` and of shared namespaces match, and only of `model_key`; None for
    either means any, None for `node` means copies on any node. With `strict`, a namespace, model
    or node that does not exist raises (the REST API answers 400) instead of simply missing."""
    with sql_cursor() as cursor:
        answer = queries.lookup(
            cursor,
            namespace=namespace,
            model_key=model_key,
            node=node,
            prefix_keys=prefix_keys,
            content_keys=content_keys,
        )
    if strict:
        if namespace is not None and answer.namespace_id is None:
            raise UnknownNamespace(f"namespace: no namespace named {namespace!r}")
        if model_key is not None and answer.model_id is None:
            raise UnknownModel(f"model_key: no model profile with key {model_key}", field="model_key")
        if node is not None and answer.node_id is None:
            raise UnknownNode(f"node: no node named {node!r}")
    return queries.lookup_result(answer, prefix_keys=prefix_keys, content_keys=content_keys)


def blocks_list(
    *,
    namespace: str | None = None,
    model: str | None = None,
    tier: str | None = None,
    node: str | None = None,
    state: str | None = None,
    ordering: str = BlockOrdering.NEWEST,
) -> QuerySet[Block]:
    """Blocks with their namespace and model, filtered; a tier/node/state filter keeps blocks that
    have at least one copy matching all three. Newest/oldest order walks the primary key."""
    blocks = Block.objects.select_related("namespace", "model")
    if namespace:
        blocks = blocks.filter(namespace__name=namespace)
    if model:
        blocks = blocks.filter(model__name=model)
    if tier or node or state:
        copies = Placement.objects.filter(block_id=OuterRef("pk"))
        if tier:
            copies = copies.filter(tier=tier)
        if node:
            copies = copies.filter(node__name=node)
        if state:
            copies = copies.filter(state=state)
        blocks = blocks.filter(Exists(copies))
    return blocks.order_by(*BLOCK_ORDERING_COLUMNS[ordering])


def block_get(*, block_id: int) -> Block | None:
    """One block with its namespace, model and every copy (three queries)."""
    return (
        Block.objects.select_related("namespace", "model")
        .prefetch_related(Prefetch("placements", queryset=Placement.objects.select_related("node").order_by("id")))
        .filter(id=block_id)
        .first()
    )


def node_admin_keys(*, nodes: Sequence[str]) -> dict[str, str | None]:
    """The admin key the control plane reads each of `nodes` with: the node's own
    (`credentials.node_admin_key`) when it has a live credential, None when its credential is
    revoked (such a node is sent nothing), the fleet-wide STRATA_NODE_ADMIN_KEY when it has none
    (nodes that run on the control plane's database credential). One query."""
    from controlplane.directory.services.credentials import node_admin_key

    keys: dict[str, str | None] = dict.fromkeys(nodes, settings.STRATA_NODE_ADMIN_KEY)
    for credential in NodeCredential.objects.filter(node__in=list(nodes)):
        keys[credential.node] = None if credential.revoked_at is not None else node_admin_key(credential)
    return keys
