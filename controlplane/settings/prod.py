"""Production settings: secrets from the environment, TLS-only cookies, HSTS."""

import os

from controlplane.runtime.environment import ConfigurationError
from controlplane.settings import base, security
from controlplane.settings.inherit import settings_of

globals().update(settings_of(base))

DEBUG = False
if len(base.SECRET_KEY) < 50:
    raise SystemExit("strata: STRATA_SECRET_KEY: production needs a random secret of at least 50 characters")
SECRET_KEY = base.SECRET_KEY

# Which requests came in over TLS, by a header the TLS-terminating proxy sets: only when the operator
# names it (STRATA_PROXY_SSL_HEADER=X-Forwarded-Proto). Trusted unasked, any client reaching the
# server directly could send it and pass for HTTPS.
try:
    SECURE_PROXY_SSL_HEADER = security.proxy_ssl_header(os.environ)
except ConfigurationError as exc:
    raise SystemExit(f"strata: {exc}") from None
SECURE_SSL_REDIRECT = os.environ.get("STRATA_SSL_REDIRECT", "true").lower() != "false"
SECURE_HSTS_SECONDS = 31536000
SECURE_HSTS_INCLUDE_SUBDOMAINS = True
SECURE_HSTS_PRELOAD = True
SECURE_CONTENT_TYPE_NOSNIFF = True
SESSION_COOKIE_SECURE = True
CSRF_COOKIE_SECURE = True
SESSION_COOKIE_HTTPONLY = True
X_FRAME_OPTIONS = "DENY"
# Health and metrics are scraped over plain HTTP inside the cluster.
SECURE_REDIRECT_EXEMPT = [r"^livez$", r"^readyz$", r"^metrics$"]

# Under ASGI every request runs in a thread of its own, so Django's persistent connections never
# outlive a request and each one would pay for a new PostgreSQL backend. A pool keeps connections
# open across requests (rows directory.rest_*lookup64_* of `make bench`; benchmarks/README.md).
# STRATA_DB_POOL_MAX=0 turns it off (e.g. behind PgBouncer in transaction mode).
_POOL_MAX = os.environ.get("STRATA_DB_POOL_MAX", "8")
if not _POOL_MAX.isdigit():
    raise SystemExit(
        f"strata: STRATA_DB_POOL_MAX: expected a whole number of connections (0 = no pool), got {_POOL_MAX!r}"
    )
if int(_POOL_MAX) > 0:
    _default = base.DATABASES["default"]
    DATABASES = {
        "default": {
            **_default,
            "CONN_MAX_AGE": 0,
            "OPTIONS": {
                **_default.get("OPTIONS", {}),
                "pool": {"min_size": min(2, int(_POOL_MAX)), "max_size": int(_POOL_MAX), "timeout": 10},
            },
        }
    }
