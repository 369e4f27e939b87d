"""The node server's request fields: each read from a JSON body and checked, or refused with an
ApiError (OpenAI's error shape) that names the field and what was wrong with it."""

from __future__ import annotations

from collections.abc import Mapping
from http import HTTPStatus
from typing import Any


class ApiError(Exception):
    """An error answered to the client in OpenAI's shape."""

    def __init__(
        self,
        status: HTTPStatus,
        message: str,
        *,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": kind, "param": param, "code": code}}


def int_field(body: Mapping[str, Any], name: str, default: int, *, minimum: int) -> int:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{name} must be an integer, got {value!r}", param=name)
    if value < minimum:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{name} must be at least {minimum}, got {value}", param=name)
    return value


def check_unicode(text: str, name: str, *, param: str) -> None:
    """Refuse text that is not valid unicode (JSON may carry a lone surrogate, which no UTF-8 encodes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(
            HTTPStatus.BAD_REQUEST, f"{name}: not valid unicode ({exc.reason} at position {exc.start})", param=param
        ) from exc


def float_field(body: Mapping[str, Any], name: str, default: float, *, minimum: float, maximum: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{name} must be a number, got {value!r}", param=name)
    if not minimum <= value <= maximum:
        raise ApiError(
            HTTPStatus.BAD_REQUEST, f"{name} must be between {minimum} and {maximum}, got {value}", param=name
        )
    return float(value)


def stop_field(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise ApiError(
            HTTPStatus.BAD_REQUEST, "stop must be a non-empty string or a list of up to 4 of them", param="stop"
        )
    return stop
