"""Dashboard pages: each renders a shell that its script fills from the REST API and the live stream.

Every page needs a login and at least the viewer role. Edit controls are rendered only for
operators and admins; the API refuses a viewer's writes whatever the page shows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from controlplane.accounts.roles import Role, role_of
from controlplane.dashboard.consumers import FLUSH_INTERVAL_S
from controlplane.directory.choices import TierLevel
from controlplane.movements.choices import MovementKind, MovementReason, MovementState
from controlplane.policies.choices import Algorithm, ModeKind, QuotaTier

PAGES = [
    ("overview", "/", "Overview"),
    ("nodes", "/nodes/", "Nodes"),
    ("blocks", "/blocks/", "Blocks"),
    ("requests", "/requests/", "Requests"),
    ("policies", "/policies/", "Policies"),
    ("movements", "/movements/", "Movements"),
]


def _choices() -> dict[str, Any]:
    return {
        "tiers": TierLevel.choices,
        "algorithms": Algorithm.choices,
        "mode_kinds": ModeKind.choices,
        "quota_tiers": QuotaTier.choices,
        "movement_states": MovementState.choices,
        "movement_kinds": MovementKind.choices,
        "movement_reasons": MovementReason.choices,
    }


def _page(
    name: str, template: str, extra: Callable[[], dict[str, Any]] | None = None
) -> Callable[[HttpRequest], HttpResponse]:
    @login_required
    def view(request: HttpRequest) -> HttpResponse:
        role = role_of(request.user)
        if role < Role.VIEWER:
            raise PermissionDenied("This account has no dashboard role (viewer, operator or admin).")
        return render(
            request,
            template,
            {
                "page": name,
                "pages": PAGES,
                "role": role.name.lower(),
                "can_edit": role >= Role.OPERATOR,
                "is_admin": role >= Role.ADMIN,
                "flush_interval_s": FLUSH_INTERVAL_S,
                **(extra() if extra else {}),
            },
        )

    view.__name__ = name
    view.__doc__ = f"The {name} page."
    return view


overview = _page("overview", "dashboard/overview.html")
nodes = _page("nodes", "dashboard/nodes.html")
blocks = _page("blocks", "dashboard/blocks.html")
requests = _page("requests", "dashboard/requests.html")
policies = _page("policies", "dashboard/policies.html", _choices)
movements = _page("movements", "dashboard/movements.html", _choices)
