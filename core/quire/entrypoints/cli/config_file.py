"""``--config FILE``: any command's flags from a YAML mapping; the command line wins.

Keys are flag names without the dashes (``max-num-seqs`` or ``max_num_seqs``). A key no
flag of the command has is an error that names it, so a typo never passes silently.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from quire.entrypoints.cli.common import UsageError

#: Dests that are the parser's own plumbing, never settable from a file.
_INTERNAL = {"help", "run", "command", "config"}


def add_config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="YAML file of flag values (the command line wins)")


def apply_config_file(command: argparse.ArgumentParser, args: argparse.Namespace) -> bool:
    """Make ``--config``'s values ``command``'s defaults; True when there was a file (the
    command line must then be parsed again, for the defaults to take).

    :raises UsageError: for an unreadable file, a non-mapping, or an unknown key.
    """
    path = getattr(args, "config", None)
    if not path:
        return False
    values = _load(Path(path))
    flags = {a.dest: a for a in command._actions if a.dest not in _INTERNAL}
    defaults: dict[str, Any] = {}
    for key, value in values.items():
        dest = str(key).replace("-", "_")
        if dest not in flags:
            known = ", ".join(sorted(d.replace("_", "-") for d in flags))
            raise UsageError(f"--config {path}: unknown key {key!r}; known keys: {known}")
        defaults[dest] = _converted(flags[dest], value, f"--config {path}: {key}")
    command.set_defaults(**defaults)
    return True


def _converted(action: argparse.Action, value: Any, where: str) -> Any:
    """``value`` as the flag's type makes it. :raises UsageError: naming ``where``."""
    # a repeatable flag (serve's --model) takes a list: its items as given
    if isinstance(action, argparse._AppendAction):
        return list(value) if isinstance(value, list) else [value]
    # argparse converts string defaults with the flag's type, and only those
    if isinstance(value, (str, bool)) or action.type is None:
        return value
    try:
        return action.type(str(value))
    except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
        raise UsageError(f"{where}: invalid value {value!r}: {exc}") from exc


def _load(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"--config: cannot read {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise UsageError(f"--config {path}: not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: expected a mapping of flag names to values, "
                         f"got {type(data).__name__}")
    return data
