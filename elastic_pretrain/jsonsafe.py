"""JSON from files somebody else may have made, and the values read out of it.

Every JSON file elastic-pretrain reads back (``trainer.json``, ``COMMITTED``, manifests, ``run.json``,
``history.jsonl``, ``summary.json``, an export's ``config.json``) goes through :func:`loads`, which turns every
way a hostile file breaks ``json.loads`` (deep nesting, 4,300-digit integers, bad UTF-8, too many bytes) into
one line naming the file. Values are checked where they are used (:func:`count`, :func:`number`,
:func:`choice` raise :class:`StateError`; the checkpointer names the file).
docs/security.md, "JSON and YAML parsing: one bounded parser".
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

from elastic_pretrain.config import MAX_NESTING, nesting_exceeds, show
from elastic_pretrain.errors import UserError

# The largest JSON file read through here: summary.json of a long run holds one entry per step.
MAX_JSON_BYTES = 1 << 30
# Counts a checkpoint holds (steps, tokens, samples, Adam's step): a float represents every integer up to
# here exactly, and int64 arithmetic on them (data positions + batch offsets) cannot overflow.
MAX_COUNT = 2**53
_NOT_OURS = "it was not written by elastic-pretrain: use another copy"


class JSONInputError(UserError, ValueError):
    """A JSON file that cannot be read as JSON; ``str(err)`` is one line naming the file.

    A ``ValueError`` too, so callers that skip an unreadable file with a warning (a torn commit
    marker) keep doing so."""


class StateError(UserError, ValueError):
    """A value of a checkpointed object's state out of its range; the caller adds the file's name."""


def loads(data: str | bytes, where: object, *, fix: str = _NOT_OURS, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """``json.loads(data)`` for a file someone else may have written: nested at most :data:`MAX_NESTING`
    levels, at most ``max_bytes`` long, integers of at most 4,300 digits; else :class:`JSONInputError`
    ``"<where>: <what is wrong>; <fix>"``."""
    if len(data) > max_bytes:
        raise JSONInputError(f"{where}: more than {max_bytes:,} bytes of JSON; {fix}")
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise JSONInputError(f"{where}: byte {err.start} is not UTF-8 text; {fix}") from None
    try:
        value = json.loads(data)
    except json.JSONDecodeError as err:
        where_in = f"line {err.lineno} column {err.colno}"
        raise JSONInputError(f"{where}: not valid JSON ({err.msg} at {where_in}); {fix}") from None
    except RecursionError:  # the C decoder's guard: a few hundred levels from the top of the stack
        raise JSONInputError(f"{where}: {_too_deep()}; {fix}") from None
    except ValueError:  # int(): more than sys.get_int_max_str_digits() digits
        raise JSONInputError(f"{where}: holds an integer of more than 4,300 digits; {fix}") from None
    if nesting_exceeds(value, MAX_NESTING):
        raise JSONInputError(f"{where}: {_too_deep()}; {fix}")
    return value


def load_object(
    data: str | bytes, where: object, *, fix: str = _NOT_OURS, max_bytes: int = MAX_JSON_BYTES
) -> dict[str, Any]:
    """:func:`loads`, and the value must be a JSON object."""
    value = loads(data, where, fix=fix, max_bytes=max_bytes)
    if not isinstance(value, dict):
        raise JSONInputError(f"{where}: {_kind(value)}, not a JSON object; {fix}")
    return value


def _too_deep() -> str:
    return f"nested deeper than {MAX_NESTING} levels (elastic-pretrain writes a few)"


def _kind(value: Any) -> str:
    """What a JSON value is, with its article: ``an array``, ``null``..."""
    names = {list: "an array", str: "a string", bool: "a boolean", type(None): "null", int: "a number",
             float: "a number", dict: "an object"}  # fmt: skip
    return names.get(type(value), type(value).__name__)


# --- values of a checkpointed state ------------------------------------------------------------------
def mapping(state: Any, what: str) -> dict[str, Any]:
    """``state`` if it is a JSON object (a checkpointed object's state always is)."""
    if not isinstance(state, dict):
        raise StateError(f"{what} is {_kind(state)}, not an object")
    return state


def _name(key: str, what: str) -> str:
    return f"{what}.{key}" if what else key


def _get(state: dict[str, Any], key: str, what: str) -> Any:
    if key not in state:
        raise StateError(f"{_name(key, what)} is missing")
    return state[key]


def count(state: dict[str, Any], key: str, what: str, *, low: int = 0, high: int = MAX_COUNT) -> int:
    """``state[key]``, an integer in ``low..high`` (a float with an integer value is taken: JSON does not
    tell 2 from 2.0, and Adam's step is saved as a float)."""
    value = _get(state, key, what)
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not (ok and value == int(value) and low <= value <= high):
        raise StateError(f"{_name(key, what)} is {show(value)}, not an integer in {low}..{high:,}")
    return int(value)


def number(state: dict[str, Any], key: str, what: str, *, low: float = 0.0, high: float = math.inf) -> float:
    """``state[key]``, a finite number in ``low..high``."""
    value = _get(state, key, what)
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not (ok and math.isfinite(value) and low <= value <= high):
        raise StateError(f"{_name(key, what)} is {show(value)}, not a finite number in {low:g}..{high:g}")
    return float(value)


def choice(state: dict[str, Any], key: str, what: str, choices: Iterable[Any]) -> Any:
    """``state[key]``, one of ``choices`` (None included where listed)."""
    value, allowed = _get(state, key, what), tuple(choices)
    if not any(value is c or (type(value) is type(c) and value == c) for c in allowed):
        raise StateError(f"{_name(key, what)} is {show(value)}, not one of {', '.join(map(repr, allowed))}")
    return value
