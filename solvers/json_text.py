"""Reading the JSON of chain and plan files strictly: a key given twice, a number too long to
read or nesting too deep is an error naming the file's kind, never a silent choice."""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Collection
from typing import Any


class _RepeatedKey(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise _RepeatedKey(key)
        found[key] = value
    return found


def parse_json(text: str, what: str, error: type[Exception] = ValueError) -> Any:
    """The JSON value in ``text``; ``error`` (its message starting with ``what``) if the text
    is not JSON, repeats a key in one object, or cannot be read."""
    try:
        return json.loads(text, object_pairs_hook=_unique)
    except _RepeatedKey as repeated:
        message = f"key {repeated.key!r} appears twice in one object: keep one"
    except json.JSONDecodeError as invalid:
        message = f"not valid JSON ({invalid})"
    except ValueError:  # an integer of thousands of digits
        message = "a number is too long to read"
    except RecursionError:
        message = f"not a {what} (JSON nested too deeply to read)"
    raise error(f"{what}: {message}")


def non_finite_at(value: Any, path: str) -> str | None:
    """Where in ``value`` (a JSON-like object) a NaN or infinity is, as ``path`` extended by
    keys and indices; None if nowhere. JSON has no such numbers, though Python reads them."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    if isinstance(value, dict):
        items = ((f"{path}.{key}", item) for key, item in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{k}]", item) for k, item in enumerate(value))
    else:
        return None
    return next((found for at, item in items if (found := non_finite_at(item, at))), None)


def check_fields(
    data: dict[str, Any],
    required: Collection[str],
    known: Collection[str],
    where: str,
    error: type[Exception] = ValueError,
) -> None:
    """Refuse unknown fields first, each with the known one it likely misspells (a missing
    field is often a misspelled one), then missing fields; ``error`` names ``where``."""
    unknown = sorted(set(data) - set(known))
    if unknown:
        guesses = [
            f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name)
            for name in unknown
            for close in [difflib.get_close_matches(name, sorted(known), n=1)]
        ]
        raise error(f"{where}: unknown field(s) {', '.join(guesses)}")
    for name in required:
        if name not in data:
            raise error(f"{where}: missing field {name!r}")
