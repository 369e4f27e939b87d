"""Failed logins, counted in the cache (Redis in every environment): after
settings.STRATA_LOGIN_FAILURES failures from one client address, or
settings.STRATA_LOGIN_USER_FAILURES for one user name from any address, within
settings.STRATA_LOGIN_WINDOW_SECONDS, every login there is refused with a 429 until that window
ends - the right password too, or the refusal would tell a guesser when it had guessed right.

The window is fixed: it starts at the first failure and is not extended by later tries. An address
is an IPv4 address or an IPv6 /64 (one host's share of a network). The per-name limit is higher
than the per-address one: one guesser locks out only its own address, many together lock the name
(its owner then waits out the window, or an admin sets a new password; both are logged). When the
cache cannot be reached, logins go on unthrottled and a warning is logged: the passwords still hold.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import logging
import math
import time
from collections.abc import Callable

from django.conf import settings
from django.core.cache import caches
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.shortcuts import render

log = logging.getLogger("strata.accounts")

LOGIN_TEMPLATE = "registration/login.html"
_PREFIX = "login-failures"


def _address(request: HttpRequest) -> str:
    raw = request.META.get("REMOTE_ADDR") or "unknown"
    try:
        ip = ipaddress.ip_address(raw)
    except ValueError:
        return raw[:64]
    if ip.version == 6:
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def _limits(request: HttpRequest) -> list[tuple[str, int, str]]:
    """(cache key, limit, what it counts) for the request's address and the user name it tries."""
    name = str(request.POST.get("username", "")).strip().casefold()
    digest = hashlib.sha256(name.encode()).hexdigest()[:32]
    return [
        (f"{_PREFIX}:address:{_address(request)}", settings.STRATA_LOGIN_FAILURES, "from your address"),
        (f"{_PREFIX}:user:{digest}", settings.STRATA_LOGIN_USER_FAILURES, "for this user name"),
    ]


def login_refusal(request: HttpRequest) -> tuple[float, str] | None:
    """(seconds left, why) when a login must be refused now, else None."""
    limits = [item for item in _limits(request) if item[1] > 0]
    cache = caches["default"]
    values = cache.get_many([key for key, _, _ in limits] + [f"{key}:until" for key, _, _ in limits])
    now = time.time()
    for key, limit, what in limits:
        until = values.get(f"{key}:until")
        if values.get(key, 0) >= limit and until is not None and until > now:
            return until - now, what
    return None


def login_failure_record(request: HttpRequest) -> None:
    """Count one failed login against the request's address and the user name it tried."""
    window = settings.STRATA_LOGIN_WINDOW_SECONDS
    cache = caches["default"]
    for key, limit, what in _limits(request):
        if limit <= 0:
            continue
        cache.add(f"{key}:until", time.time() + window, timeout=window)
        count = 1
        if not cache.add(key, 1, timeout=window):
            try:
                count = cache.incr(key)
            except ValueError:  # the window ended between the two calls
                cache.set(key, 1, timeout=window)
        if count == limit:
            log.warning(
                "login: %d failed logins %s (last from %s) within %d s; logins there are refused until the window ends",
                limit,
                what.replace("your", "one"),
                _address(request),
                window,
            )


def _refused(request: HttpRequest, seconds: float, what: str) -> HttpResponse:
    minutes = max(1, math.ceil(seconds / 60))
    message = (
        f"Too many failed logins {what}: try again in {minutes} minute{'s' if minutes > 1 else ''}. "
        "Until then every login there is refused."
    )
    response = render(request, LOGIN_TEMPLATE, {"throttled": message, "next": request.POST.get("next", "")}, status=429)
    response["Retry-After"] = str(math.ceil(seconds))
    return response


def login_throttled(view: Callable[..., HttpResponseBase]) -> Callable[..., HttpResponseBase]:
    """Wrap a login view (Django's, the admin's): a POST the throttle refuses never reaches it, and
    a POST it answers with the form again (not a redirect) counts as a failed login."""

    @functools.wraps(view)
    def wrapped(request: HttpRequest, *args: object, **kwargs: object) -> HttpResponseBase:
        if request.method != "POST":
            return view(request, *args, **kwargs)
        try:
            refusal = login_refusal(request)
        except Exception as exc:  # noqa: BLE001 - the cache is down: the passwords still hold
            log.warning("login throttle: the cache cannot be read (%s); this login is not throttled", exc)
            return view(request, *args, **kwargs)
        if refusal is not None:
            return _refused(request, *refusal)
        response = view(request, *args, **kwargs)
        if response.status_code == 200:
            try:
                login_failure_record(request)
            except Exception as exc:  # noqa: BLE001
                log.warning("login throttle: a failed login could not be counted (%s)", exc)
        return response

    return wrapped
