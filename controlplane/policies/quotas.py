"""Namespace quota writes: how many bytes a tenant's blocks may hold in the host, disk and remote tiers.

A quota is part of the versioned policy state: each create, change and delete writes a new
PolicyVersion through the same lock and checks as every other policy edit (so a rollback restores
the quotas of its version, and the diff names them), and the nodes and the planner are told after
commit. The planner's quota pass moves the namespace's own coldest blocks out of a tier it is over;
the nodes enforce the same numbers at write-back.
"""

from __future__ import annotations

from django.db import transaction

from controlplane.directory.models import Namespace
from controlplane.policies import rules
from controlplane.policies.errors import PolicyError
from controlplane.policies.models import NamespaceQuota
from controlplane.policies.services import _begin, _version_write


def _namespace_known(name: str) -> None:
    if not Namespace.objects.filter(name=name).exists():
        raise PolicyError(f"namespace: no namespace named {name!r}", field="namespace")


@transaction.atomic
def namespacequota_create(
    *, namespace: str, tier: str, bytes: int, author: str = "", comment: str = ""
) -> NamespaceQuota:
    """Cap `namespace`'s bytes in `tier` (host and disk: on each node; remote: the whole fleet).
    The namespace must exist and have no quota in that tier yet."""
    before = _begin()
    clean = rules.fields_check({"namespace": namespace, "tier": tier, "bytes": bytes}, rules.QUOTA_RULES)
    _namespace_known(clean["namespace"])
    if NamespaceQuota.objects.filter(namespace=namespace, tier=tier).exists():
        raise PolicyError(
            f"tier: namespace {namespace!r} already has a {tier} quota; change that one instead", field="tier"
        )
    row = NamespaceQuota.objects.create(**clean)
    _version_write(
        before=before, action="namespace-quota.create", author=author, comment=comment or f"create quota {row}"
    )
    return row


@transaction.atomic
def namespacequota_update(*, quota: NamespaceQuota, bytes: int, author: str = "", comment: str = "") -> NamespaceQuota:
    """Change how many bytes a quota allows (its namespace and tier are what it is for)."""
    before = _begin()
    clean = rules.fields_check({"bytes": bytes}, rules.QUOTA_RULES)
    quota = NamespaceQuota.objects.get(pk=quota.pk)
    previous = quota.bytes
    quota.bytes = clean["bytes"]
    quota.save()
    _version_write(
        before=before,
        action="namespace-quota.update",
        author=author,
        comment=comment or f"update quota {quota}: bytes {previous} -> {quota.bytes}",
    )
    return quota


@transaction.atomic
def namespacequota_delete(*, quota: NamespaceQuota, author: str = "", comment: str = "") -> None:
    """Delete a quota: the namespace's bytes in that tier are limited by the tier's policy alone again."""
    before = _begin()
    label = str(quota)
    NamespaceQuota.objects.filter(pk=quota.pk).delete()
    _version_write(
        before=before, action="namespace-quota.delete", author=author, comment=comment or f"delete quota {label}"
    )
