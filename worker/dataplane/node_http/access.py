"""Who may read a node's operator endpoints: the node's admin key reads everything, a tenant's API
key reads its own namespace's request timelines, and anyone else is refused with the reason.

Both node servers use it (Strata's own engine server and the status server beside vLLM), so the
rules are the same whichever engine serves the model. Keys are compared in constant time."""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from email.message import Message
from http import HTTPStatus
from typing import Any

ADMIN_KEY_SETTING = "STRATA_NODE_ADMIN_KEY"


class Denied(Exception):
    """A request the node refuses: the HTTP status and an OpenAI-style error body naming why."""

    def __init__(self, status: HTTPStatus, message: str, *, kind: str) -> None:
        super().__init__(message)
        self.status = status
        self.body: dict[str, Any] = {
            "error": {"message": message, "type": kind, "param": None, "code": "invalid_api_key"}
        }


def bearer(headers: Message) -> str:
    """The key of an `Authorization: Bearer KEY` header ("" without one)."""
    auth = headers.get("Authorization", "")
    return auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""


def is_admin(key: str, admin_key: str) -> bool:
    """Whether `key` is the node's admin key (never when the node has none)."""
    return bool(key and admin_key) and hmac.compare_digest(key.encode(), admin_key.encode())


def require_admin(headers: Message, *, admin_key: str, what: str) -> None:
    """Refuse unless the request carries the node's admin key; `what` names the endpoint."""
    if not admin_key:
        raise Denied(
            HTTPStatus.FORBIDDEN, f"{what}: off on this node; set {ADMIN_KEY_SETTING}", kind="permission_error"
        )
    if not is_admin(bearer(headers), admin_key):
        raise Denied(
            HTTPStatus.UNAUTHORIZED,
            f"{what}: only with the node's admin key (Authorization: Bearer <{ADMIN_KEY_SETTING}>)",
            kind="authentication_error",
        )


def timeline_reader(headers: Message, *, admin_key: str, api_keys: Mapping[str, str]) -> str | None:
    """Whose request timelines the request may read: None for every namespace (the admin key),
    or the one namespace of a tenant's API key. Anything else is refused."""
    key = bearer(headers)
    if is_admin(key, admin_key):
        return None
    for tenant_key, namespace in api_keys.items():
        if key and hmac.compare_digest(key.encode(), tenant_key.encode()):
            return namespace
    if not admin_key and not api_keys:
        raise Denied(
            HTTPStatus.FORBIDDEN,
            f"request timelines: off on this node; set {ADMIN_KEY_SETTING}",
            kind="permission_error",
        )
    raise Denied(
        HTTPStatus.UNAUTHORIZED,
        f"request timelines: only with the node's admin key (Authorization: Bearer <{ADMIN_KEY_SETTING}>), "
        "or a tenant's API key for that tenant's own requests",
        kind="authentication_error",
    )
