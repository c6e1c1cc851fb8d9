"""A run = a YAML file in ``jobs/`` that names presets (``parallel: cpu-ep2``, ``data: stdlib-code``)
plus dotted CLI overrides (``model.loops=4``). :func:`load_job` resolves all of it into a typed
:class:`~elastic_pretrain.job.JobConfig`. A decider job also reads its base checkpoint's ``trainer.json``
here, which is why loading sits above ``checkpoint/`` while the schema (job.py) sits below it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elastic_pretrain.checkpoint.store import read_trainer_state, resolve_checkpoint
from elastic_pretrain.config import ConfigError, apply_overrides, build, load_yaml, parse_override, set_value
from elastic_pretrain.errors import UserError
from elastic_pretrain.job import JobConfig, shape_changes

# Sections that may name a preset file: section -> folder at the repository root.
PRESET_DIRS = {"parallel": "parallel", "data": "data"}


def repo_root_for(job_path: Path) -> Path:
    """Presets are looked up beside the job's folder (``jobs/../parallel``), then in the cwd."""
    return job_path.resolve().parent.parent


def _resolve_preset(section: str, value: Any, roots: list[Path]) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise ConfigError(f"{section}: expected a preset name or a mapping, got {value!r}")
    folder = PRESET_DIRS[section]
    if value.endswith((".yaml", ".yml")):  # a file of its own (data=/path/recipe.yaml), not a preset name
        path = Path(value).expanduser()
        if not path.is_file():
            raise ConfigError(f"{section}: {value}: no such file (give a YAML path or a preset name in {folder}/)")
        return load_yaml(path)
    for root in roots:
        path = root / folder / f"{value}.yaml"
        if path.is_file():
            return load_yaml(path)
    known = sorted({p.stem for root in roots for p in (root / folder).glob("*.yaml")})
    raise ConfigError(f"{section}: no preset '{value}' in {folder}/ (known: {', '.join(known) or 'none'})")


def load_job(
    path: Path | str, overrides: list[str] | None = None, *, values: dict[str, str] | None = None
) -> JobConfig:
    """Job YAML + presets + ``key.path=value`` overrides → validated :class:`JobConfig`.

    ``values`` (dotted key -> string) are set last and verbatim, never parsed as YAML: paths from flags
    such as ``--run-dir`` may hold ``#``, ``: `` or ``~``, which an override would turn into a comment,
    a mapping or null."""
    path = Path(path)
    raw = load_yaml(path)
    overrides = list(overrides or [])
    parsed = [(parse_override(o), o) for o in overrides]
    # Top-level overrides first (they may swap a preset: parallel=cpu-tp2), then presets, then the rest.
    raw = apply_overrides(raw, [o for (keys, _), o in parsed if len(keys) == 1])
    raw.setdefault("name", path.stem)
    roots = [repo_root_for(path), Path.cwd()]
    for section in PRESET_DIRS:
        if section in raw:
            raw[section] = _resolve_preset(section, raw[section], roots)
    raw = apply_overrides(raw, [o for (keys, _), o in parsed if len(keys) > 1])
    for key, value in (values or {}).items():
        set_value(raw, key.split("."), value, what=key)
    base = _decider_base(raw)
    job = build(JobConfig, raw)
    if base is not None:
        changes = shape_changes(base, job)
        if changes:
            raise ConfigError(
                f"model: differs in shape from the decider's base checkpoint ({'; '.join(changes)}): "
                "drop those model keys (a decider job takes the model from decider.init_from)"
            )
    return job


def _decider_base(raw: dict[str, Any]) -> dict[str, Any] | None:
    """A decider job post-trains a base checkpoint: pin ``decider.init_from`` to its committed step,
    take the model from it (job keys on top) and the loop-conditioning phase (no depth schedule:
    every micro-batch runs L_max). Returns the base's config, or None for an ordinary job."""
    section = raw.get("decider")
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ConfigError(f"decider: expected a mapping of DeciderConfig fields, got {section!r}")
    if not section.get("init_from"):
        raise ConfigError(
            "decider.init_from: missing: name the base run directory or checkpoint to post-train "
            "(e.g. decider.init_from: runs/tiny-cpu)"
        )
    if str(section["init_from"]).endswith(".yaml"):
        raise ConfigError(
            f"decider.init_from: {section['init_from']} is a job file (`elastic-pretrain experiment` puts its run "
            "here): name the base run directory or checkpoint (decider.init_from=runs/<base>)"
        )
    try:
        step = resolve_checkpoint(Path(section["init_from"]))
        meta = read_trainer_state(step)
    except UserError as err:
        raise ConfigError(f"decider.init_from: {err} (train the base job first)") from None
    if "schedule" in raw:
        raise ConfigError(
            "schedule: a decider job runs every pass (L_max) and takes the loop-conditioning phase from "
            "decider.init_from: drop the schedule section"
        )
    base = meta.get("config", {})
    section["init_from"] = str(step)
    raw["model"] = {**base.get("model", {}), **(raw.get("model") or {})}
    raw["schedule"] = {"switch_at": 0.0 if meta.get("controller", {}).get("phase") == "mixed" else 1.0}
    return base
