"""Directory writes, one module per job: nodes (heartbeats, states), catalog (namespaces, model
profiles), blocks (registration, touches, purges) and placements (the epoch-guarded copy
lifecycle). Every service is importable from here."""

from controlplane.directory.services.blocks import (
    PurgeCounts,
    blocks_purge,
    blocks_register,
    blocks_registered_announce,
    blocks_touch,
)
from controlplane.directory.services.catalog import (
    modelprofile_create,
    modelprofile_delete,
    modelprofile_ensure,
    modelprofile_key,
    namespace_create,
    namespace_delete,
    namespace_ensure,
    namespace_update,
)
from controlplane.directory.services.nodes import (
    TierReport,
    node_heartbeat,
    node_mark_down,
    node_payload,
    nodes_mark_stale,
)
from controlplane.directory.services.placements import (
    PendingCopy,
    PlacementFlip,
    placement_create_pending,
    placement_delete,
    placement_flip,
    placement_mark_corrupt,
    placement_mark_deleting,
    placement_mark_ready,
    placements_change,
    placements_create_pending_many,
    placements_delete_many,
    placements_flip_many,
)

__all__ = [
    "PendingCopy",
    "PlacementFlip",
    "PurgeCounts",
    "TierReport",
    "blocks_purge",
    "blocks_register",
    "blocks_registered_announce",
    "blocks_touch",
    "modelprofile_create",
    "modelprofile_delete",
    "modelprofile_ensure",
    "modelprofile_key",
    "namespace_create",
    "namespace_delete",
    "namespace_ensure",
    "namespace_update",
    "node_heartbeat",
    "node_mark_down",
    "node_payload",
    "nodes_mark_stale",
    "placement_create_pending",
    "placement_delete",
    "placement_flip",
    "placement_mark_corrupt",
    "placement_mark_deleting",
    "placement_mark_ready",
    "placements_change",
    "placements_create_pending_many",
    "placements_delete_many",
    "placements_flip_many",
]
