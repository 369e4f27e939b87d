"""The API's JSON parser: DRF's, with a bound on nesting.

Python's json module parses nesting recursively: a body of 100000 `[` raises RecursionError,
which DRF's parser does not catch (a 500). Nesting that parses but runs deep (hundreds of levels)
would fail later instead, wherever the data is copied, validated or written back. No request of
this API nests more than a few levels, so anything deeper than `MAX_DEPTH` is a 400 naming the
limit, decided before any view sees the data.
"""

from __future__ import annotations

from typing import Any

from rest_framework import parsers
from rest_framework.exceptions import ParseError

MAX_DEPTH = 64
"""Arrays and objects inside one another, the outermost counting as 1."""


def deeper_than(data: Any, limit: int) -> bool:
    """Whether `data` (as json.loads returns it) nests arrays and objects more than `limit` deep.
    One level at a time, without recursion; scalars are skipped without a look inside."""
    level = [data] if type(data) in (dict, list) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        inner = []
        for value in level:
            for item in value.values() if type(value) is dict else value:
                kind = type(item)
                if kind is dict or kind is list:
                    inner.append(item)
        level = inner
    return False


def too_deep() -> ParseError:
    return ParseError(f"JSON parse error - arrays and objects nested deeper than {MAX_DEPTH} levels")


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser, answering nesting deeper than `MAX_DEPTH` with a ParseError (400)."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        try:
            data = super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise too_deep() from None
        if deeper_than(data, MAX_DEPTH):
            raise too_deep()
        return data
