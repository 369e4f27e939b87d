"""The API's documentation pages (Swagger UI and ReDoc), served from the installed sidecar package
with a Content-Security-Policy that lets them load nothing from another host: what they run is
what pyproject.toml pins, and they work offline. (ReDoc's own attribution logo, which it asks of
its CDN, is refused by the policy and not shown.)"""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from drf_spectacular.views import SpectacularRedocView, SpectacularSwaggerView
from rest_framework.request import Request
from rest_framework.response import Response

DOCS_CSP = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self' 'unsafe-inline'",  # each page starts its viewer with an inline script
        "style-src 'self' 'unsafe-inline'",
        "img-src 'self' data:",
        "font-src 'self' data:",
        "worker-src 'self' blob:",  # ReDoc searches in a worker it makes from a blob
        "connect-src 'self'",
    ]
)


class SwaggerView(SpectacularSwaggerView):
    @extend_schema(exclude=True)  # a page about the API, not an operation of it
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        response = super().get(request, *args, **kwargs)
        response["Content-Security-Policy"] = DOCS_CSP
        return response


class RedocView(SpectacularRedocView):
    @extend_schema(exclude=True)  # a page about the API, not an operation of it
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        response = super().get(request, *args, **kwargs)
        response["Content-Security-Policy"] = DOCS_CSP
        return response
