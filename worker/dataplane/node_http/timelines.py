"""GET /v1/strata/requests, as every node serves it (Strata's own server and the status server of
an engine Strata does not serve itself): the newest request timelines first, `?limit=N` of them
(RECENT unless asked; at most what the engine keeps), a limit that is not a whole number of at
least 1 refused with a 400 that names it. Who may read them: `access.timeline_reader`."""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable
from http import HTTPStatus
from typing import Any

from worker.dataplane.offload_records import RequestTrace

PATH = "/v1/strata/requests"
RECENT = 50
"""Request timelines answered when the query names no limit."""


def requests_answer(
    query: str, *, node: str, traces: Iterable[RequestTrace], namespace: str | None = None
) -> tuple[HTTPStatus, dict[str, Any]]:
    """The status and JSON body answering `PATH?query` from `traces` (oldest first): all of them,
    or only `namespace`'s when a tenant asks."""
    limit = urllib.parse.parse_qs(query, keep_blank_values=True).get("limit", [str(RECENT)])[-1]
    if not (limit.isascii() and limit.isdigit()) or int(limit) < 1:  # "²" is a digit, not a number
        return HTTPStatus.BAD_REQUEST, {
            "error": {
                "message": f"limit must be a whole number of requests, at least 1; got {limit!r}",
                "type": "invalid_request_error",
                "param": "limit",
                "code": None,
            }
        }
    readable = [trace for trace in traces if namespace is None or trace.namespace == namespace]
    recent = [trace.as_dict() for trace in readable[-int(limit) :]]
    return HTTPStatus.OK, {"node": node, "requests": recent[::-1]}
