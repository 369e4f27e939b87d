"""How the node's option values are read and checked: sizes, numbers, flags, names, tier lists,
API keys and choices, each parser raising ValueError with what it expected (the option table in
`config` names the option in front of it)."""

from __future__ import annotations

import re
import shlex
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from worker.dataplane.blend.options import SELECTIONS
from worker.dataplane.directory import ENGINES
from worker.dataplane.tier_names import TIER_ORDER

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "ki": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "mi": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "gi": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
    "ti": 1024**4,
    "p": 1000**5,
    "pb": 1000**5,
    "pib": 1024**5,
    "pi": 1024**5,
}


def parse_size(value: Any) -> int:
    """Bytes from an int or a string such as '512MiB', '2 GB', '1048576'."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size in bytes, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative, got {value}")
        return value
    match = _SIZE_RE.match(str(value))
    if not match:
        raise ValueError(f"expected a size such as 512MiB or 2GB, got {value!r}")
    number, unit = match.groups()
    return int(float(number) * _SIZE_UNITS[(unit or "").lower()])


def parse_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got {value!r}")
    return int(value)


def parse_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    return float(value)


def parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in {"1", "true", "yes", "on"}:
        return True
    if text in {"0", "false", "no", "off"}:
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def parse_str(value: Any) -> str:
    return str(value)


def parse_postgres_url(value: Any) -> str:
    """A libpq URL (postgresql:// or postgres://) naming a database, or empty for none."""
    text = str(value).strip()
    if not text:
        return ""
    try:
        parts = urllib.parse.urlsplit(text)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as exc:
        raise ValueError(f"expected a postgresql:// URL, got an unreadable one ({exc})") from None
    if parts.scheme not in ("postgresql", "postgres"):
        raise ValueError(f"expected a postgresql:// URL, got scheme {parts.scheme or 'none'!r}")
    if not parts.path.strip("/"):
        raise ValueError("expected a postgresql:// URL naming its database (postgresql://user@host/dbname)")
    return text


def parse_path(value: Any) -> Path:
    return Path(str(value)).expanduser()


_NODE_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")


class TierList(tuple):
    """Tier names in lookup order (fastest first); prints as the comma list it is read from."""

    def __str__(self) -> str:
        return ",".join(self)


def parse_tiers(value: Any) -> TierList:
    names = [part.strip().lower() for part in (value.split(",") if isinstance(value, str) else value)]
    names = [name for name in names if name]
    unknown = sorted(set(names) - set(TIER_ORDER))
    if unknown:
        raise ValueError(f"unknown tier(s) {', '.join(unknown)}; expected any of {', '.join(TIER_ORDER)}")
    if len(set(names)) != len(names):
        raise ValueError(f"a tier is listed twice in {value!r}")
    return TierList(sorted(names, key=TIER_ORDER.index))


_POOL_NAME_RE = re.compile(r"^[A-Za-z0-9{][A-Za-z0-9_.{}-]{0,120}$")


def parse_pool_name(value: Any) -> str:
    text = str(value)
    if not _POOL_NAME_RE.match(text):
        raise ValueError(f"expected letters, digits, '.', '_', '-' and {{node}}, got {text!r}")
    return text


def parse_node_name(value: Any) -> str:
    text = str(value)
    if not _NODE_NAME_RE.match(text):
        raise ValueError(
            f"expected 1-63 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit, got {text!r}"
        )
    return text


_NODE_GROUP_RE = re.compile(r"^[A-Za-z0-9_-]{1,63}$")


def parse_node_group(value: Any) -> str:
    text = str(value)
    if not _NODE_GROUP_RE.match(text):
        raise ValueError(f"expected 1-63 letters, digits, '_' or '-', got {text!r}")
    return text


_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def parse_namespace(value: Any) -> str:
    text = str(value).strip()
    if not _NAMESPACE_RE.match(text):
        raise ValueError(f"namespace {text!r} must be 1-63 letters, digits, '.', '_' or '-'")
    return text


def parse_api_keys(value: Any) -> dict[str, str]:
    if isinstance(value, dict):
        pairs = [(str(k), str(v)) for k, v in value.items()]
    else:
        text = str(value).strip()
        pairs = []
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, namespace = item.partition("=")
            if not sep or not key or not namespace:
                raise ValueError(f"expected key=namespace pairs separated by commas, got {item!r}")
            pairs.append((key, namespace))
    for _key, namespace in pairs:
        if not _NAMESPACE_RE.match(namespace):
            raise ValueError(f"namespace {namespace!r} of a key must be 1-63 letters, digits, '.', '_' or '-'")
    return dict(pairs)


def check_positive(value: Any) -> str | None:
    return None if value > 0 else "must be greater than zero"


def check_between(low: float, high: float, unit: str) -> Callable[[Any], str | None]:
    """A check that a value lies between `low` and `high` (both allowed); its message names the
    range accepted."""

    def check(value: Any) -> str | None:
        return None if low <= value <= high else f"must be {low:g} to {high:g} {unit}"

    return check


def check_heartbeat(value: Any) -> str | None:
    """The control plane accepts heartbeat intervals of 0.1 to 3600 s (a node may not declare
    itself alive for longer): refused at start rather than at every heartbeat."""
    return None if 0.1 <= value <= 3600 else "must be 0.1 to 3600 seconds (the control plane refuses others)"


def check_non_negative(value: Any) -> str | None:
    return None if value >= 0 else "cannot be negative"


def check_percent(value: Any) -> str | None:
    return None if 0 <= value <= 100 else "must be between 0 and 100 percent"


def check_fraction(value: Any) -> str | None:
    return None if 0 <= value <= 1 else "must be between 0 and 1"


def check_at_least_one(value: Any) -> str | None:
    return None if value >= 1 else "must be at least 1"


def check_step_percent(value: Any) -> str | None:
    return None if 0 < value <= 100 else "must be more than 0 and at most 100 percent"


VERIFY_MODES = ("full", "header")
"""How a moved copy is verified before its flip (`move_verify`)."""

FAULT_POINTS = ("after-reserve", "after-copy", "after-flip")
"""Where movements hold when fault injection is armed (`fault_point`)."""

NATIVE_COPY_CHOICES = ("1", "0", "sse2")
"""Values of `native_copy`: the best build of the fused copy-and-hash for the CPU, none, the SSE2 one."""


def parse_choice(choices: tuple[str, ...], *, empty: bool = False) -> Callable[[Any], str]:
    """A parser accepting one of `choices` (and '' when `empty`), as written."""

    def parse(value: Any) -> str:
        text = str(value)
        if not (text in choices or (empty and text == "")):
            raise ValueError(f"expected one of {', '.join(choices)}, got {text!r}")
        return text

    return parse


def parse_native_copy(value: Any) -> str:
    text = str(value).strip().lower() or "1"
    if text not in NATIVE_COPY_CHOICES:
        raise ValueError(f"expected one of {', '.join(NATIVE_COPY_CHOICES)}, got {text!r}")
    return text


def parse_seconds(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected a number of seconds, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number of seconds, got {value!r}") from None


def parse_engine(value: Any) -> str:
    text = str(value).strip().lower()
    if text not in ENGINES:
        raise ValueError(f"expected one of {', '.join(ENGINES)}, got {value!r}")
    return text


def parse_args(value: Any) -> tuple[str, ...]:
    if isinstance(value, (list, tuple)):
        return tuple(str(item) for item in value)
    try:
        return tuple(shlex.split(str(value)))
    except ValueError as exc:
        raise ValueError(f"expected command-line arguments, got {value!r}: {exc}") from exc


def parse_selection(value: Any) -> str:
    text = str(value).strip().lower()
    if text not in SELECTIONS:
        raise ValueError(f"expected one of {', '.join(SELECTIONS)}, got {value!r}")
    return text
