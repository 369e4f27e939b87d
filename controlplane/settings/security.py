"""Security integration: login throttling, the Content-Security-Policy and the proxy's TLS header,
read from the environment here; a bad value raises ConfigurationError naming the variable."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from controlplane.runtime.environment import ConfigurationError

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'self'",
        # Every script is a file under /static (the dashboard's, uPlot's, the admin's): none inline.
        "script-src 'self'",
        # The dashboard's scripts size bars with style attributes; the admin and the browsable
        # API inline a little CSS. Styles cannot run code.
        "style-src 'self' 'unsafe-inline'",
        "img-src 'self' data:",
        "font-src 'self'",
        # The live stream: a websocket to this host (ws: and wss: for browsers whose 'self' does
        # not cover them).
        "connect-src 'self' ws: wss:",
        "object-src 'none'",
        "base-uri 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)
"""The policy every page gets unless its view sets its own (the API docs do: controlplane/docs.py)."""

_HEADER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,63}$")
_BOOLEANS = {"true", "false", "yes", "no", "on", "off", "1", "0"}


def _whole(environ: Mapping[str, str], name: str, default: int, meaning: str) -> int:
    raw = environ.get(name, "").strip() or str(default)
    if not re.fullmatch(r"[0-9]{1,9}", raw):
        raise ConfigurationError(f"{name}: expected a whole number of {meaning}, got {raw!r}")
    return int(raw)


def settings(environ: Mapping[str, str]) -> dict[str, Any]:
    window = _whole(environ, "STRATA_LOGIN_WINDOW_SECONDS", 900, "seconds")
    if window < 1:
        raise ConfigurationError("STRATA_LOGIN_WINDOW_SECONDS: must be at least 1 second")
    return {
        # Failed logins (dashboard and admin) within the window before a client address, or a
        # user name from any address, is refused (429) until the window ends; 0 = no limit.
        "STRATA_LOGIN_FAILURES": _whole(environ, "STRATA_LOGIN_FAILURES", 10, "failed logins (0 = no limit)"),
        "STRATA_LOGIN_USER_FAILURES": _whole(environ, "STRATA_LOGIN_USER_FAILURES", 50, "failed logins (0 = no limit)"),
        "STRATA_LOGIN_WINDOW_SECONDS": window,
        "STRATA_CONTENT_SECURITY_POLICY": CONTENT_SECURITY_POLICY,
    }


def proxy_ssl_header(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """SECURE_PROXY_SSL_HEADER from STRATA_PROXY_SSL_HEADER: the header (e.g. X-Forwarded-Proto)
    whose value `https` marks a request the proxy received over TLS. Unset: no header is trusted,
    since any client that reaches the server directly could send it."""
    raw = environ.get("STRATA_PROXY_SSL_HEADER", "").strip()
    if not raw:
        return None
    if raw.lower() in _BOOLEANS or not _HEADER.match(raw):
        raise ConfigurationError(
            "STRATA_PROXY_SSL_HEADER: expected the name of the header the TLS-terminating proxy sets, "
            f"such as X-Forwarded-Proto (unset: trust none), got {raw!r}"
        )
    return ("HTTP_" + raw.upper().replace("-", "_"), "https")
