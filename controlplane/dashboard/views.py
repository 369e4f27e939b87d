"""Dashboard pages."""

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from controlplane.accounts.roles import role_of


@login_required
def live(request: HttpRequest) -> HttpResponse:
    """Nodes and their tiers, updated live over the websocket."""
    return render(request, "dashboard/live.html", {"role": role_of(request.user).name.lower()})
