"""``pdserve``'s subcommands come from one table (pd.cli.COMMANDS): each resolves to a callable, is listed in the
usage, and an unknown one is exit 2 naming it."""

from __future__ import annotations

import importlib

import pytest

from pd import cli


@pytest.mark.parametrize("command", cli.COMMANDS, ids=lambda c: c.name)
def test_every_subcommand_resolves_and_is_listed(command):
    module, function = command.target.split(":")
    assert callable(getattr(importlib.import_module(module), function))
    assert f"  {command.name} " in cli.USAGE


def test_an_unknown_subcommand_is_exit_2_naming_it(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve-all"])
    assert e.value.code == 2 and "unknown command 'serve-all'" in capsys.readouterr().err


def test_a_missing_extra_is_exit_2_with_the_install_command(monkeypatch, capsys):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "ray" else object())
    with pytest.raises(SystemExit) as e:
        cli.main(["up"])
    assert e.value.code == 2 and "pip install 'pdserve[cpu]'" in capsys.readouterr().err
