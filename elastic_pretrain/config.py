"""Typed configuration: dataclasses built from YAML, presets by name, dotted overrides.

Each component owns a small ``@dataclass(kw_only=True)`` config; a parent nests child configs.
Field docs live in the ``doc`` metadata of each field; validation lives in ``__post_init__`` of the
config that owns the field and raises :class:`ConfigError` with a message that says how to fix it.

Building from untrusted dicts (YAML, CLI) goes through :func:`build`, which rejects unknown keys
and values of the wrong type with one line naming the dotted key.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml

from elastic_pretrain.errors import UserError

T = TypeVar("T")


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
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(repr(c) for c in choices)}")
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
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of {_type_name(tp)}")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return build(tp, value, prefix=key + ".")
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {value!r} (write it as [a, b, ...])")
        (item_tp, *_) = get_args(tp) or (Any,)
        items = [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        k_tp, v_tp = get_args(tp) or (Any, Any)
        return {_coerce(k, k_tp, key): _coerce(v, v_tp, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r} (quote it in YAML)")
    if tp is Path:
        return Path(value)
    return value


def build(cls: type[T], data: dict[str, Any] | None, prefix: str = "") -> T:
    """Build dataclass ``cls`` from a plain dict, rejecting unknown keys and ill-typed values."""
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), list(fields), n=1)
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


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"model.loops=4"`` -> (["model", "loops"], 4). Values are parsed as YAML scalars/lists."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' has no '=': write it as key.path=value, e.g. model.loops=4")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{text}': the key must be a dotted path like train.steps")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set dotted keys in a nested dict (validation of the keys happens in :func:`build`)."""
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override '{text}': '{part}' is a value, not a section")
            node = child
        node[path[-1]] = value
    return data


def load_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML mapping with a one-line error for missing / malformed files."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such file (check the path; jobs live in jobs/, presets in parallel/ and data/)")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", err)
        raise ConfigError(f"{path}:{where} is not valid YAML ({problem}): fix the syntax") from None
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
