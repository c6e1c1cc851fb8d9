"""``elastic-pretrain prepare-data <recipe> [key=value ...]``: build shards + manifest for a data recipe."""

from __future__ import annotations

import argparse
import dataclasses
import sys
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


def _prepare(args: argparse.Namespace) -> int:
    from elastic_pretrain.data.prepare import manifest_summary, prepare_data

    cfg = load_recipe(args.recipe, args.overrides)
    manifest = prepare_data(cfg, progress=not args.quiet, say=print)
    assert cfg.prepare is not None
    print(
        f"{cfg.prepare.output}: {manifest.format} shards, tokenizer {manifest.tokenizer['kind']} "
        f"({manifest.tokenizer['fingerprint'][:12]})",
        file=sys.stdout,
    )
    print(manifest_summary(manifest), file=sys.stdout)
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "prepare-data",
        help="tokenise a corpus into MDS / WebDataset shards with a manifest",
        description="Build the shards a data recipe describes (idempotent: a complete matching "
        "manifest means there is nothing to do).",
    )
    p.add_argument("recipe", help="data recipe YAML or preset name in data/, e.g. stdlib-code")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. prepare.max_tokens=1e6")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler=_prepare)
