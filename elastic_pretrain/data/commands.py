"""``elastic-pretrain prepare-data <recipe> [key=value ...]``: build shards + manifest for a data recipe."""

from __future__ import annotations

import argparse
import sys

from elastic_pretrain.data.recipes import load_recipe


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
