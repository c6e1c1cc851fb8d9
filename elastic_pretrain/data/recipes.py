"""Data recipes by name or path: load one, find the user's recipe matching a checkpoint, check one fits a model.

Shared by ``prepare-data`` and ``eval --data`` (a command module may not import another: tests/test_layering.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from elastic_pretrain.config import ConfigError, apply_overrides, build, load_yaml
from elastic_pretrain.data.config import DataConfig

_REPO = Path(__file__).resolve().parents[2]


def resolve_recipe(name_or_path: str) -> Path:
    """A YAML path as given, or a preset name looked up as ``data/<name>.yaml`` in the cwd, then the repo."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        return path
    for root in (Path.cwd(), _REPO):
        candidate = root / "data" / f"{name_or_path}.yaml"
        if candidate.is_file():
            return candidate
    known = sorted(p.stem for p in (_REPO / "data").glob("*.yaml"))
    raise ConfigError(f"no data recipe '{name_or_path}' (presets: {', '.join(known) or 'none'}); give a YAML path")


def load_recipe(name_or_path: str, overrides: list[str] | None = None) -> DataConfig:
    """Recipe YAML (or preset name) + dotted overrides -> validated :class:`DataConfig`."""
    raw = apply_overrides(load_yaml(resolve_recipe(name_or_path)), list(overrides or []))
    return build(DataConfig, raw)


def matching_recipe(trained: DataConfig) -> tuple[str, DataConfig] | None:
    """The user's own recipe (``data/*.yaml`` in the cwd, then the repository) that resolves to exactly the
    checkpoint's ``data`` section, if one does: then every location ``eval`` reads is one the user's file
    states, and the checkpoint chose nothing (``eval`` without ``--data``)."""
    seen: set[Path] = set()
    for root in (Path.cwd(), _REPO):
        for path in sorted((root / "data").glob("*.yaml")):
            if path.resolve() in seen or not path.is_file():
                continue
            seen.add(path.resolve())
            try:
                cfg = load_recipe(str(path))
            except ConfigError:
                continue
            if cfg == trained:
                return str(path), cfg
    return None


def check_eval_recipe(cfg: DataConfig, trained: DataConfig, vocab_size: int, *, flag: str = "--data") -> None:
    """The user's recipe (``eval --data``) can measure this model: its tokenizer is the one the model was
    trained with (only the file's location may differ) and fits the model's vocabulary, and its rows are
    no longer than the trained context.

    The recipe, not the checkpoint, says where data is read, fetched and cached: a checkpoint from
    someone else chose ``local: ~`` and ``split: .ssh``, and a refetch replaced ``~/.ssh/authorized_keys``
    (issue 35, item 3). The checkpoint's own ``data`` section only tells which tokenizer to expect."""
    from elastic_pretrain.data.tokenizer import load_tokenizer

    mine, theirs = (dataclasses.replace(t, path=None) for t in (cfg.tokenizer, trained.tokenizer))
    if mine != theirs:
        raise ConfigError(
            f"{flag}: the recipe's tokenizer ({mine}) is not the one the checkpoint was trained with ({theirs}); "
            "give a recipe whose held-out data was tokenised like the model's"
        )
    if cfg.seq_len > trained.seq_len:  # RoPE positions past the trained context were never seen
        raise ConfigError(
            f"{flag}: the recipe's seq_len {cfg.seq_len} is longer than the {trained.seq_len} the checkpoint was "
            "trained at; use a recipe with seq_len <= that"
        )
    if load_tokenizer(cfg.tokenizer).vocab_size > vocab_size:
        raise ConfigError(f"{flag}: the recipe's tokenizer has more ids than the model's {vocab_size}; use the model's")
