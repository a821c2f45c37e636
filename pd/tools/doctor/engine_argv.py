"""The reference engine's argv of each role (``pd/commands/reference.py``, a group's ``extra_args`` included),
parsed by the engine's own parser into its settings (pd.engines.settings) and the ``--speculative-*`` settings
resolved as the engine resolves them at start (``pd.engines.spec.config.resolve_speculative``), so the doctor and
the engine refuse the same things. Neither imports torch: the doctor runs in the base install.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from pd.config import PDConfig

if TYPE_CHECKING:
    from pd.engines.settings import EngineSettings
    from pd.engines.spec.config import SpecConfig


class _Refused(Exception):
    """What argparse would print before exiting."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse exits here; the doctor reports instead
        raise _Refused(message)


@dataclass
class EngineArgs:
    """One role's reference-engine settings.

    Attributes:
        args: the parsed settings (None when the argv does not parse or a value is refused; see ``error``).
        error: argparse's or the settings model's message for an argv it refuses ("" when it parses).
        spec: the resolved speculative settings (None: off, or refused; see ``spec_error``).
        spec_error: the engine's own start-up message for speculative flags it refuses ("" when none).
    """

    args: Optional[EngineSettings] = None
    error: str = ""
    spec: Optional[SpecConfig] = None
    spec_error: str = ""


def parse_reference_args(cfg: PDConfig, role: str) -> EngineArgs:
    """Build ``role``'s reference-engine command from the config and parse it as ``pdserve engine`` would."""
    from pd.commands.reference import reference_command
    from pd.engines.errors import EngineSettingsError
    from pd.engines.settings import engine_flags, parse_settings
    from pd.engines.spec.config import resolve_speculative

    try:
        cmd = reference_command(cfg, role, "127.0.0.1", 30000, 8998 if role == "prefill" else None)
    except EngineSettingsError as e:
        return EngineArgs(error=str(e))
    parser = _Parser(prog="pdserve engine", allow_abbrev=False, exit_on_error=False)
    engine_flags().add_to(parser, "engine")
    try:
        settings = parse_settings(cmd.argv[cmd.args_start:], environ={}, parser=parser)
    except (_Refused, argparse.ArgumentError, EngineSettingsError) as e:
        return EngineArgs(error=str(e))
    out = EngineArgs(args=settings)
    try:
        out.spec = resolve_speculative(settings.speculative, settings.model_path)
    except EngineSettingsError as e:  # the engine refuses these flags at start with this message
        out.spec_error = str(e)
    return out
