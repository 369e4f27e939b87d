"""Error pages: under /api/ a JSON body saying what went wrong (as every API answer is), elsewhere
Django's own pages. Django answers these before any API view runs (a path no route matches, a
request it cannot parse), so the API's error format would otherwise stop at its views."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views import defaults

API_PREFIX = "/api/"


def not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    if request.path.startswith(API_PREFIX):
        return JsonResponse({"detail": f"no API route {request.path}"}, status=404)
    return defaults.page_not_found(request, exception)


def bad_request(request: HttpRequest, exception: Exception) -> HttpResponse:
    if request.path.startswith(API_PREFIX):
        return JsonResponse({"detail": f"the request could not be read: {exception}"}, status=400)
    return defaults.bad_request(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
    if request.path.startswith(API_PREFIX):
        return JsonResponse({"detail": "internal error (logged on the server)"}, status=500)
    return defaults.server_error(request)
