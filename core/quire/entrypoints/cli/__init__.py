"""The ``quire`` command line: one module per subcommand, registered on one parser.

To add a subcommand, write ``quire/entrypoints/cli/<name>.py`` with ``register(subparsers)`` that adds
its parser and sets ``run`` (``(argparse.Namespace) -> int``) as a default, then list the
module in :data:`COMMANDS`. A subcommand may have subcommands of its own (``quire bench
throughput``); global options and ``--config`` then belong to the innermost ones.
Errors caused by the user's input are raised as :class:`~quire.entrypoints.cli.common.UsageError`
and printed argparse-style, never as a traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from quire.entrypoints.cli import (
    bench,
    common,
    conformance,
    generate,
    models,
    plugins,
    serve,
)
from quire.entrypoints.cli.config_file import add_config_option, apply_config_file
from quire.entrypoints.cli.engine_options import expand_bare_flags

#: Subcommand modules, in the order ``quire --help`` lists them.
COMMANDS = (generate, serve, bench, models, plugins, conformance)


def build_parser() -> argparse.ArgumentParser:
    """The parser for ``quire``, with every subcommand in :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="quire", description="Quire: LLM inference with pluggable hardware platforms."
    )
    common.add_global_options(parser)
    subparsers = parser.add_subparsers(title="commands", dest="command", required=True)
    for command in COMMANDS:
        command.register(subparsers)
    # Global options are accepted after the subcommand too; SUPPRESS keeps a subcommand's
    # unset default from overwriting a value given before it.
    for subparser in subparsers.choices.values():
        common.add_global_options(subparser, default=argparse.SUPPRESS)
        nested = _subcommands(subparser)
        for leaf in nested.choices.values() if nested else (subparser,):
            if leaf is not subparser:
                common.add_global_options(leaf, default=argparse.SUPPRESS)
            add_config_option(leaf)
    parser.set_defaults(_commands=subparsers.choices)
    return parser


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    """``parser``'s own subcommands (``bench`` has ``throughput``, ...), or None."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


def _chosen_command(args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost parser the command line chose: the one whose flags it was given."""
    command = args._commands[args.command]
    nested = _subcommands(command)
    return nested.choices[getattr(args, nested.dest)] if nested else command


def parse_args(parser: argparse.ArgumentParser,
               argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv``, taking values from ``--config`` where the command line gives none.

    :raises UsageError: for a bad config file, with the chosen command as its ``prog``;
        argparse's own errors exit as usual, with the usage of the command they concern.
    """
    words = list(sys.argv[1:] if argv is None else argv)
    expanded = expand_bare_flags(parser, words)
    args = _parse(parser, expanded)
    command = _chosen_command(args)
    try:
        if apply_config_file(command, args):
            args = _parse(parser, expanded)
    except common.UsageError as exc:
        exc.prog = command.prog
        raise
    # what a command that starts copies of itself (serve's API servers) parses again
    args.argv = words
    return args


def _parse(parser: argparse.ArgumentParser, words: list[str]) -> argparse.Namespace:
    """``words`` parsed; a word no flag takes is reported by the innermost subcommand
    (``quire serve: error: unrecognized arguments``, after serve's usage), where
    ``parse_args`` would show quire's usage, which lists no flag of serve's."""
    args, extras = parser.parse_known_args(words)
    if extras:
        _chosen_command(args).error(f"unrecognized arguments: {' '.join(extras)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``quire`` with ``argv`` (default: ``sys.argv[1:]``) and return the exit status."""
    parser = build_parser()
    try:
        args = parse_args(parser, argv)
    except SystemExit as exc:  # argparse printed help (0) or a usage error (2) already
        return exc.code if isinstance(exc.code, int) else 2
    except common.UsageError as exc:
        return _report(exc, exc.prog or parser.prog)
    try:
        return args.run(args)
    except common.UsageError as exc:
        return _report(exc, exc.prog or _chosen_command(args).prog)


def _report(exc: common.UsageError, prog: str) -> int:
    """Print ``exc`` in one line as argparse words its errors; the exit status 2."""
    print(f"{prog}: error: {exc}", file=sys.stderr)
    return 2
