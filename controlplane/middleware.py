"""A Content-Security-Policy on every response (Django 5.2 has none of its own; 6.0 will).

The policy is settings.STRATA_CONTENT_SECURITY_POLICY (controlplane/settings/security.py): scripts
only from this server's files, so a value that slips through into a page cannot run. A view that
needs another policy sets its own header, and it is kept (the API docs: controlplane/docs.py).
"""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponseBase

HEADER = "Content-Security-Policy"


class ContentSecurityPolicyMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        response = self.get_response(request)
        # Django's debug error page runs an inline script; it only exists with DEBUG on.
        if HEADER not in response and not (settings.DEBUG and response.status_code >= 500):
            response[HEADER] = settings.STRATA_CONTENT_SECURITY_POLICY
        return response
