"""A node process's own connections: Django's PostgreSQL connection and the Celery broker's, given
the node's connect and statement timeouts, TCP keepalives and TCP user timeout.

The directory client opens connections of its own with the same options (`worker.postgres_directory`);
these are the rest: heartbeats, policies, movements and the broker the node's tasks come from.
"""

from __future__ import annotations

import re
from typing import Any

from worker.dataplane.config import NodeConfig
from worker.dataplane.network import ConnectionOptions

_STATEMENT_TIMEOUT = re.compile(r"\s*-c\s*statement_timeout\s*=\s*\S+")


def database_options_apply(
    config: NodeConfig, *, databases: dict[str, Any] | None = None, alias: str = "default"
) -> dict[str, Any]:
    """Give Django's connection `alias` (of `databases`, by default Django's own settings) the
    node's libpq options and statement timeout (sent as a startup option, so no statement runs
    without it), for every connection it opens from now on; call before the first query. A
    statement timeout in the database URL's own `options` gives way to the node's. Returns the
    options in force."""
    if databases is None:
        from django.conf import settings

        databases = settings.DATABASES
    connection = ConnectionOptions.from_config(config)
    options = databases[alias].setdefault("OPTIONS", {})
    startup = _STATEMENT_TIMEOUT.sub("", str(options.get("options", ""))).strip()
    options.update(connection.libpq())
    options["options"] = f"{startup} -c statement_timeout={connection.statement_timeout_ms()}".strip()
    return dict(options)


def broker_options_apply(app: Any, config: NodeConfig) -> dict[str, Any]:
    """Give the Celery app's broker connection (Redis) the node's socket timeouts, keepalives and
    health checks, beside the transport options the settings already hold; call before the
    worker starts. Returns the transport options in force."""
    connection = ConnectionOptions.from_config(config)
    options = {**(app.conf.broker_transport_options or {}), **connection.broker_transport()}
    app.conf.broker_transport_options = options
    app.conf.broker_connection_timeout = connection.broker_timeout_s
    return options
