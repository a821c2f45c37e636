"""The reference engine's argv of each role (``pd/commands/reference.py``, a group's ``extra_args`` included),
parsed by the engine's own parser and its ``--speculative-*`` settings resolved as the engine resolves them at
start (``pd.engines.spec.config.resolve_spec_config``), so the doctor and the engine refuse the same things.
Neither imports torch: the doctor runs in the base install.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from pd.config import PDConfig


class _Refused(Exception):
    """What argparse would print before exiting."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse exits here; the doctor reports instead
        raise _Refused(message)


@dataclass
class EngineArgs:
    """One role's reference-engine flags.

    Attributes:
        args: the parsed namespace (None when the argv does not parse; see ``error``).
        error: argparse's message for an argv it refuses ("" when it parses).
        spec: the resolved speculative settings (None: off, or refused; see ``spec_error``).
        spec_error: the engine's own start-up message for speculative flags it refuses ("" when none).
    """

    args: Optional[argparse.Namespace] = None
    error: str = ""
    spec: Optional[object] = None  # pd.engines.spec.config.SpecConfig
    spec_error: str = ""


def parse_reference_args(cfg: PDConfig, role: str) -> EngineArgs:
    """Build ``role``'s reference-engine command from the config and parse it as ``pdserve engine`` would."""
    from pd.commands.reference import reference_command
    from pd.engines.args import add_engine_args
    from pd.engines.spec.config import resolve_spec_config

    cmd = reference_command(cfg, role, "127.0.0.1", 30000, 8998 if role == "prefill" else None)
    parser = _Parser(prog="pdserve engine", allow_abbrev=False, exit_on_error=False)
    add_engine_args(parser)
    try:
        ns, rest = parser.parse_known_args(cmd.argv[cmd.args_start:])
    except (_Refused, argparse.ArgumentError) as e:
        return EngineArgs(error=str(e))
    if rest:
        return EngineArgs(error=f"unrecognized arguments: {' '.join(rest)}")
    out = EngineArgs(args=ns)
    try:
        out.spec = resolve_spec_config(ns)
    except SystemExit as e:  # the engine refuses these flags at start with this message
        out.spec_error = str(e)
    return out
