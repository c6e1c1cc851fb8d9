"""``elastic-pretrain`` command line. The only place that parses argv.

Each concern registers its own sub-commands in ``elastic_pretrain/<concern>/commands.py`` through
``add_commands(subparsers)``; a command's handler receives the parsed namespace and returns an exit
code. Errors a user can fix (:class:`~elastic_pretrain.errors.UserError`) print as one line.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn

from elastic_pretrain.errors import UserError
from elastic_pretrain.quiet import third_party_warnings

COMMAND_MODULES = (
    "elastic_pretrain.train.commands",
    "elastic_pretrain.data.commands",
    "elastic_pretrain.checkpoint.commands",
    "elastic_pretrain.tracking.commands",
    "elastic_pretrain.launch.commands",
    "elastic_pretrain.eval.commands",
    "elastic_pretrain.experiments.commands",
    "elastic_pretrain.parallel.commands",
    "elastic_pretrain.export.commands",
    "elastic_pretrain.engine.commands",
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line + exit 2, like every other user error
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _version() -> str:
    """The installed distribution's version (pyproject.toml), read without importing torch."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("elastic-pretrain")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed: pip install -e .)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="elastic-pretrain", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"elastic-pretrain {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:  # a missing dependency inside the module is a real error
                raise
            continue
        module.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    third_party_warnings()  # the user sees the command's own output, not its libraries' deprecations
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may follow flags (train job.yaml --nproc-per-node 2 train.steps=5)
    if (
        extra
        and isinstance(getattr(args, "overrides", None), list)
        and all("=" in e and not e.startswith("-") for e in extra)
    ):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from elastic_pretrain.launch.local import peer_reported, report_user_error

    try:
        return int(args.handler(args) or 0)
    except UserError as err:
        if not report_user_error(str(err)):  # a rank under train --nproc-per-node: the launcher prints it once
            print(f"elastic-pretrain {args.command}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `elastic-pretrain config --reference | head`: the reader left, nothing is wrong here
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at interpreter exit
        return 1
    except Exception:
        if peer_reported():  # another rank stopped on a user error and broke a collective here
            return 2
        raise
    except KeyboardInterrupt:
        print(f"elastic-pretrain {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
