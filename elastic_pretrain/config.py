"""Typed configuration: dataclasses built from YAML, presets by name, dotted overrides.

Each component owns a small ``@dataclass(kw_only=True)`` config; a parent nests child configs.
Field docs live in the ``doc`` metadata of each field; validation lives in ``__post_init__`` of the
config that owns the field and raises :class:`ConfigError` with a message that says how to fix it.

Building from untrusted dicts (YAML, CLI) goes through :func:`build`, which rejects unknown keys
and values of the wrong type with one line naming the dotted key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import re
import reprlib
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml

from elastic_pretrain.errors import UserError

T = TypeVar("T")

# A YAML document (or override value) may hold at most this many values once its aliases (``*a``)
# are expanded: 437 bytes of nested aliases otherwise expand to ~10^9 values in any code that walks
# or prints them (to_dict, repr in an error message).
MAX_YAML_VALUES = 100_000
# Nesting depth of a YAML document or a JSON file read back (jsonsafe.py): a job nests 3-4 levels, our JSON
# files ~6; PyYAML's composer and our own walkers recurse once per level, and a few hundred levels would be a
# RecursionError traceback (a YAML alias adds the depth of what it names, so aliases can multiply it).
MAX_NESTING = 64
# Integers a config holds: int64 (what torch, numpy and Slurm take).
INT_LIMIT = 2**63 - 1
_TOO_DEEP = f"nests lists/mappings more than {MAX_NESTING} levels deep: a job needs a few; write it flatter"
_UNREADABLE = "holds a number too long to read (more than 4,300 digits): give a value that fits in 64 bits"


class ConfigError(UserError, ValueError):
    """A bad configuration value; ``str(err)`` is one line naming the key and the fix."""


def field(default: Any = dataclasses.MISSING, *, doc: str, factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with a docstring (shown by ``elastic-pretrain config --help``-style tools)."""
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata={"doc": doc})
    return dataclasses.field(default=default, metadata={"doc": doc})


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _big_int(value: int) -> str | None:
    if value.bit_length() <= 256:
        return None
    return f"<an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits>"


def show(value: Any, limit: int = 80) -> str:
    """``repr(value)`` for an error message, bounded: at most ``limit`` characters whatever the value
    (a 5,000-digit integer, a list expanded from YAML aliases)."""
    if isinstance(value, int) and (big := _big_int(value)):
        return big
    if isinstance(value, list | tuple | dict) and len(value) > 8:
        return f"<a {type(value).__name__} of {len(value)} items>"
    text = _bounded_repr.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def clip(text: str, limit: int = 80) -> str:
    """``text`` cut to ``limit`` characters (for one-line messages that quote input)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _BoundedRepr(reprlib.Repr):
    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxlist, self.maxtuple, self.maxdict, self.maxstring, self.maxother = 3, 8, 8, 8, 80, 80

    def repr_int(self, x: int, level: int) -> str:
        return _big_int(x) or repr(x)  # builtins.repr refuses integers of more than 4,300 digits


_bounded_repr = _BoundedRepr()


def nesting_exceeds(value: Any, limit: int) -> bool:
    """Whether lists/dicts in ``value`` nest more than ``limit`` levels deep (without recursion; a value
    reached twice through shared objects is walked once per depth it is reached at, at most ``limit``)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    seen: set[tuple[int, int]] = set()
    while stack:
        v, depth = stack.pop()
        if not isinstance(v, list | dict) or (id(v), depth) in seen:
            continue
        if depth >= limit:
            return True
        seen.add((id(v), depth))
        stack.extend((child, depth + 1) for child in (v.values() if isinstance(v, dict) else v))
    return False


def check_expansion(value: Any, where: str) -> None:
    """Refuse values that hold more than :data:`MAX_YAML_VALUES` values once YAML aliases are expanded
    (counted over shared objects without expanding them), that contain themselves, or that nest deeper
    than :data:`MAX_NESTING` levels (an alias adds the depth of what it names)."""
    done: dict[int, tuple[int, int]] = {}  # id -> (values, levels below), each shared object walked once
    active: set[int] = set()

    def walk(v: Any, depth: int) -> tuple[int, int]:
        if not isinstance(v, list | dict):
            return 1, 0
        key = id(v)
        if key not in done:
            if key in active:
                raise ConfigError(f"{where}: a YAML alias (*name) refers to its own anchor (&name): write it out")
            if depth >= MAX_NESTING:  # before recursing further: the walk's own depth stays bounded
                raise ConfigError(f"{where}: {_TOO_DEEP}")
            active.add(key)
            total, levels = 1, 0
            for child in v.values() if isinstance(v, dict) else v:
                n, below = walk(child, depth + 1)
                total, levels = total + n, max(levels, below + 1)
                if total > MAX_YAML_VALUES:
                    raise ConfigError(
                        f"{where}: holds more than {MAX_YAML_VALUES:,} values once its YAML aliases (*name) are "
                        "expanded: write the values out instead of nesting aliases"
                    )
            active.discard(key)
            done[key] = (total, levels)
        if depth + done[key][1] >= MAX_NESTING:  # a shared value first met higher up, reached here deeper
            raise ConfigError(f"{where}: {_TOO_DEEP}")
        return done[key]

    walk(value, 0)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert ``value`` to annotation ``tp``; raise ConfigError naming ``key``."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        choices = get_args(tp)
        if isinstance(value, bool) and ("on" if value else "off") in choices:
            return "on" if value else "off"  # YAML 1.1 reads an unquoted on/off as true/false
        if value not in choices:
            raise ConfigError(f"{key}: {show(value)} is not one of {', '.join(repr(c) for c in choices)}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {show(value)} matches none of {_type_name(tp)}")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {tp.__name__} fields, got {show(value)}")
        return build(tp, value, prefix=key + ".")
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {show(value)} (write it as [a, b, ...])")
        (item_tp, *_) = get_args(tp) or (Any,)
        items = [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {show(value)}")
        k_tp, v_tp = get_args(tp) or (Any, Any)
        return {_coerce(k, k_tp, key): _coerce(v, v_tp, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {show(value)}")
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) > INT_LIMIT:
                raise ConfigError(f"{key}: {show(value)} is out of range: give an integer below 2**63 (9.2e18)")
            return value
        raise ConfigError(f"{key}: expected an integer, got {show(value)}")
    if tp is float:
        number: float | None = None
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value) if abs(value) < 1e308 else math.inf
        elif isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            with contextlib.suppress(ValueError):
                number = float(value)
        if number is None:
            raise ConfigError(f"{key}: expected a number, got {show(value)}")
        if not math.isfinite(number):  # YAML's .nan / .inf: every comparison in a check is False for nan
            raise ConfigError(f"{key}: {show(value)} is not a finite number: give an ordinary value like 3.0e-4")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {show(value)} (quote it in YAML)")
    if tp is Path:
        if not isinstance(value, str | Path):
            raise ConfigError(f"{key}: expected a path, got {show(value)} (quote it in YAML)")
        return Path(value)
    return value


def build(cls: type[T], data: dict[str, Any] | None, prefix: str = "") -> T:
    """Build dataclass ``cls`` from a plain dict, rejecting unknown keys and ill-typed values."""
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = unknown[0] if isinstance(unknown[0], str) else show(unknown[0])
        close = difflib.get_close_matches(key, list(fields), n=1)
        hint = f"did you mean '{prefix}{close[0]}'?" if close else f"valid keys: {', '.join(sorted(fields))}"
        raise ConfigError(f"unknown key '{prefix}{key}': {hint}")
    kwargs = {name: _coerce(value, hints[name], prefix + name) for name, value in data.items()}
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"missing required key '{prefix}{missing[0]}'")
    try:
        return cls(**kwargs)
    except ConfigError as err:
        msg = str(err)
        raise ConfigError(msg if msg.startswith(prefix) or not prefix else f"{prefix}{msg}") from None


def to_dict(cfg: Any) -> Any:
    """Plain-data view of a config (YAML/JSON serialisable)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, list | tuple):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, Path):
        return str(cfg)
    return cfg


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (for MLflow params and config diffs)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class _TooDeep(yaml.YAMLError):
    """A YAML document nested more than :data:`MAX_NESTING` levels (refused while composing: PyYAML's
    composer recurses once per level, and ~300 levels were a RecursionError traceback)."""

    def __init__(self, line: int) -> None:
        super().__init__(f"line {line}")
        self.line = line


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader with a bound on nesting depth."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self._depth >= MAX_NESTING:
            raise _TooDeep(self.peek_event().start_mark.line + 1)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def safe_load(text: str) -> Any:
    """``yaml.safe_load`` of ``text``, nested at most :data:`MAX_NESTING` levels (else :class:`_TooDeep`)."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"model.loops=4"`` -> (["model", "loops"], 4). Values are parsed as YAML scalars/lists."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' has no '=': write it as key.path=value, e.g. model.loops=4")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{text}': the key must be a dotted path like train.steps")
    try:
        value = safe_load(raw) if raw.strip() else ""
    except _TooDeep:
        raise ConfigError(f"override '{key}': {_TOO_DEEP}") from None
    except yaml.YAMLError:
        value = raw
    except ValueError:  # PyYAML lets int()'s error through: an integer of more than 4,300 digits
        raise ConfigError(f"override '{key}': {_UNREADABLE}") from None
    check_expansion(value, f"override '{key}'")
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set dotted keys in a nested dict (validation of the keys happens in :func:`build`)."""
    for text in overrides:
        path, value = parse_override(text)
        set_value(data, path, value, what=f"override '{text}'")
    return data


def set_value(data: dict[str, Any], path: list[str], value: Any, *, what: str) -> None:
    """``data[path[0]][path[1]]... = value``, creating sections; ``value`` is stored as given (no YAML)."""
    node = data
    for part in path[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{what}: '{part}' is a value, not a section")
        node = child
    node[path[-1]] = value


def load_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML mapping with a one-line error for missing / malformed files."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such file (check the path; jobs live in jobs/, presets in parallel/ and data/)")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{path}: byte {err.start} (0x{raw[err.start]:02x}) is not UTF-8 text: save the file as UTF-8"
        ) from None
    try:
        data = safe_load(text)
    except _TooDeep as err:
        raise ConfigError(f"{path}: line {err.line} {_TOO_DEEP}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", err)
        raise ConfigError(f"{path}:{where} is not valid YAML ({clip(str(problem), 160)}): fix the syntax") from None
    except ValueError:  # PyYAML lets int()'s error through: an integer of more than 4,300 digits
        raise ConfigError(f"{path}: {_UNREADABLE}") from None
    check_expansion(data, str(path))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys at the top level, got {type(data).__name__}")
    return data


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; values in ``top`` win."""
    out = dict(base)
    for k, v in top.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_bytes(text: str) -> int:
    """'80GiB', '141GB', '80G', '1.5TiB', '12345' → bytes (GB = 10^9, GiB and bare G = 2^30)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B?)\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ConfigError(f"--gpu-memory: cannot read {text!r}: write a size such as 80GiB, 141GB or 96G")
    value, unit, suffix = float(m.group(1)), m.group(2).upper(), m.group(3).lower()
    power = "KMGT".index(unit) + 1 if unit else 0
    base = 1000 if suffix == "b" and unit else 1024
    return int(value * base**power)
