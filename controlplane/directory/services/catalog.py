"""Directory writes about what blocks belong to: namespaces and model profiles, and the ones a
node ensures before it serves."""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from django.db import IntegrityError, transaction
from django.utils.text import slugify

from controlplane.directory.errors import (
    DirectoryError,
    InUse,
)
from controlplane.directory.models import Block, ModelProfile, Namespace
from worker.dataplane import profile as dataplane_profile

# -- namespaces ------------------------------------------------------------------------------------


@transaction.atomic
def namespace_create(*, name: str, shared: bool = False, description: str = "") -> Namespace:
    """A new namespace with a fresh random salt."""
    if Namespace.objects.filter(name=name).exists():
        raise DirectoryError(f"name: a namespace named {name!r} exists", field="name")
    return Namespace.objects.create(name=name, shared=shared, description=description)


@transaction.atomic
def namespace_update(*, namespace: Namespace, shared: bool | None = None, description: str | None = None) -> Namespace:
    """Change whether other namespaces may match this one's blocks, or its description (never the salt:
    that would orphan every block in it)."""
    if shared is not None:
        namespace.shared = shared
    if description is not None:
        namespace.description = description
    namespace.save(update_fields=["shared", "description"])
    return namespace


@transaction.atomic
def namespace_delete(*, namespace: Namespace) -> None:
    """Delete an empty namespace; one that still has blocks must be purged first."""
    if Block.objects.filter(namespace=namespace).exists():
        raise InUse(f"namespace: {namespace.name!r} still has blocks; purge them first", field="namespace")
    namespace.delete()


# -- model profiles --------------------------------------------------------------------------------


def modelprofile_key(
    *,
    model_id: str,
    layers: int,
    kv_heads: int,
    head_dim: int,
    dtype: str,
    block_tokens: int,
    revision: str,
    rope_theta: float,
    rope_scaling: str,
) -> tuple[uuid.UUID, dict[str, Any]]:
    """The data plane's model key of a layout and the layout as the data plane canonicalises it."""
    profile = dataplane_profile.ModelProfile(
        model_id=model_id,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        block_tokens=block_tokens,
        revision=revision,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
    )
    return dataplane_profile.model_key(profile), dataclasses.asdict(profile)


_LAYOUT_FIELDS = ("model_id", "layers", "kv_heads", "head_dim", "block_tokens", "revision", "rope_theta")


@transaction.atomic
def modelprofile_create(
    *,
    name: str,
    model_id: str,
    layers: int,
    kv_heads: int,
    head_dim: int,
    dtype: str = "bfloat16",
    block_tokens: int = 256,
    revision: str = "main",
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | str | None = None,
) -> ModelProfile:
    """A model profile and its model key; a second profile of the very same layout is refused."""
    if isinstance(rope_scaling, dict):
        rope_scaling = json.dumps(rope_scaling, sort_keys=True, separators=(",", ":")) if rope_scaling else ""
    try:
        key, layout = modelprofile_key(
            model_id=model_id,
            layers=layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            block_tokens=block_tokens,
            revision=revision,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling or "",
        )
    except ValueError as exc:
        # The data plane's messages start with the field they are about ("layers must be ...")
        # or mention the dtype; keep the field so the API can name it.
        text = str(exc)
        field = text.split(" ", 1)[0] if text.split(" ", 1)[0] in _LAYOUT_FIELDS else "dtype"
        raise DirectoryError(f"{field}: {text}", field=field) from exc
    existing = ModelProfile.objects.filter(model_key=key).first()
    if existing is not None:
        # The model key is derived from the model id and the layout together: no one field is wrong.
        raise DirectoryError(
            f"profile {existing.name!r} has the same model and layout (model key {key})", field="non_field_errors"
        )
    if ModelProfile.objects.filter(name=name).exists():
        raise DirectoryError(f"name: a model profile named {name!r} exists", field="name")
    return ModelProfile.objects.create(name=name, model_key=key, **layout)


@transaction.atomic
def modelprofile_delete(*, profile: ModelProfile) -> None:
    """Delete a profile no block refers to."""
    if Block.objects.filter(model=profile).exists():
        raise InUse(f"model: {profile.name!r} still has blocks; purge them first", field="model")
    profile.delete()


# -- what a node needs before it serves ------------------------------------------------------------


@transaction.atomic
def namespace_ensure(*, name: str) -> Namespace:
    """The namespace `name`, created (with a fresh salt) if it does not exist yet."""
    namespace = Namespace.objects.filter(name=name).first()
    if namespace is not None:
        return namespace
    try:
        with transaction.atomic():
            return Namespace.objects.create(name=name)
    except IntegrityError:  # another node created it a moment ago
        return Namespace.objects.get(name=name)


@transaction.atomic
def modelprofile_ensure(*, profile: Any) -> ModelProfile:
    """The model profile of a data-plane profile (worker.dataplane.profile.ModelProfile), created
    under a name derived from the model and its key when no profile has that layout yet."""
    key, layout = modelprofile_key(
        model_id=profile.model_id,
        layers=profile.layers,
        kv_heads=profile.kv_heads,
        head_dim=profile.head_dim,
        dtype=profile.dtype,
        block_tokens=profile.block_tokens,
        revision=profile.revision,
        rope_theta=profile.rope_theta,
        rope_scaling=profile.rope_scaling,
    )
    existing = ModelProfile.objects.filter(model_key=key).first()
    if existing is not None:
        return existing
    name = f"{(slugify(profile.model_id) or 'model')[:54]}-{key.hex[:8]}"
    try:
        with transaction.atomic():
            return ModelProfile.objects.create(name=name, model_key=key, **layout)
    except IntegrityError:
        return ModelProfile.objects.get(model_key=key)
