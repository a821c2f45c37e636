"""Command-line flags generated from a pydantic settings model: ``pdserve router``'s (pd.router.config) and
``pdserve engine``'s (pd.engines.settings).

Every leaf field of the model (and of its sections: the router's ``retry``, the engine's ``speculative``, ...) is
one flag. Its name is the field's ``flag(...)`` metadata, else the section's ``FLAG`` rule applied to
the key (``"--retry-{}"``); its help is the field's docstring with the model's default; its form
follows the type (``int`` / ``float`` a typed value, ``Literal`` choices, ``tuple[str, ...]`` one
or more values, ``bool`` ``--x`` / ``--no-x``, ``Optional[T]`` as ``T``). ``switch`` metadata adds
a flag without a value that sets the field to a constant (``--disable-retries``); ``env`` metadata
reads an environment variable when no flag sets the field. Flags default to ``argparse.SUPPRESS``: a
flag not given leaves its setting to the settings file, the environment or the model. ``argv`` goes
the other way: the flags that give a settings object.
"""

from __future__ import annotations

import argparse
import types
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional, TypeGuard, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

_NO_DEFAULT = object()


@dataclass(frozen=True)
class SettingFlag:
    """The flags of one setting.

    Attributes:
        path: the field's keys from the top model (``("retry", "max_retries")``).
        options: the option strings of its value flag (first = the name), empty when it has none.
        switch: ``(flag, value)`` of its flag without a value, if any.
        env: environment variable read when no flag sets it.
        kwargs: ``add_argument`` keywords of the value flag (type, nargs, choices, action, help).
        section: the key of the section it is in (None at the top level).
    """

    path: tuple[str, ...]
    options: tuple[str, ...]
    switch: Optional[tuple[str, Any]]
    env: Optional[str]
    kwargs: dict
    section: Optional[str]

    @property
    def dotted(self) -> str:
        """``retry.max_retries``."""
        return ".".join(self.path)

    @property
    def name(self) -> str:
        """The flag named in errors: the value flag, else the switch."""
        if self.options:
            return self.options[0]
        assert self.switch is not None  # a setting without a value flag has a switch (flag(takes_value=False))
        return self.switch[0]


def _is_section(annotation: object) -> TypeGuard[type[BaseModel]]:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _form(annotation, where: str) -> dict:
    """``add_argument`` keywords for a value of type ``annotation``.

    Raises:
        TypeError: a type without a flag form (give the field ``flag(switch=...)`` or another type).
    """
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _form(rest[0], where)
    elif origin is Literal:
        return {"choices": args}
    elif origin in (tuple, list) and args and (origin is list or args[1:] == (Ellipsis,)):
        return {**_form(args[0], where), "nargs": "+"}
    elif annotation is str:
        return {}
    elif annotation in (int, float):
        return {"type": annotation}
    elif annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    raise TypeError(f"setting {where}: no command-line form for {annotation!r}")


def _shown(value) -> str:
    if isinstance(value, (tuple, list)):
        return " ".join(str(v) for v in value)
    return str(value)


def _help(info: FieldInfo, default, env: Optional[str]) -> str:
    text = " ".join((info.description or "").split()).rstrip(".")
    if env is not None:
        text += f" (default ${env})"
    elif default is not None and default is not _NO_DEFAULT:
        text += f" (default {_shown(default)})"
    return _plain(text)


def _plain(text: str) -> str:
    """Docstring markup out, ``%`` escaped (argparse formats help with %)."""
    return text.replace("``", "").replace("%", "%%")


class SettingsFlags:
    """The flags of every leaf setting of ``model``.

    Args:
        model: the settings model (``RouterSettings``, ``EngineSettings``, or a subclass); it and each section
            have a ``FLAG`` class variable, the rule that names a key's flag (``"--retry-{}"``).
        skip: top-level keys that get no generated flag (those with hand-written ones).

    Raises:
        TypeError: a field whose type has no command-line form.
    """

    def __init__(self, model: type[BaseModel], skip: tuple[str, ...] = ()):
        self.model = model
        self.flags: list[SettingFlag] = []
        self._sections: dict[str, str] = {}  # section key -> group title
        for key, info in model.model_fields.items():
            if key in skip:
                continue
            section = info.annotation
            if _is_section(section):
                self._sections[key] = _plain(" ".join((info.description or key).split()).rstrip("."))
                for sub, sub_info in section.model_fields.items():
                    self.flags.append(self._flag(section, (key, sub), sub_info, key))
            else:
                self.flags.append(self._flag(model, (key,), info, None))
        self._by_path = {f.dotted: f for f in self.flags}
        self._dests: list[tuple[str, SettingFlag, Any]] = []  # (dest, flag, switch value or _NO_DEFAULT)

    @staticmethod
    def _flag(owner: type[BaseModel], path: tuple[str, ...], info: FieldInfo, section: Optional[str]) -> SettingFlag:
        meta: dict[str, Any] = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        rule: str = getattr(owner, "FLAG")  # the model's flag naming rule, a ClassVar of each settings model
        name = meta.get("flag", rule.format(path[-1].replace("_", "-")))
        switch = tuple(meta["switch"]) if meta.get("switch") else None
        env = meta.get("env")
        options = (name, *meta.get("aliases", ())) if name else ()
        default = info.get_default(call_default_factory=True) if not info.is_required() else _NO_DEFAULT
        kwargs = {}
        if options:
            kwargs = {**_form(info.annotation, ".".join(path)), "help": _help(info, default, env)}
        return SettingFlag(path, options, switch, env, kwargs, section)

    def add_to(self, parser: argparse.ArgumentParser, title: str) -> None:
        """Add every flag to ``parser``: top-level settings in one group named ``title``, each section in its
        own. Value flags come first in a group, then its switches. ``given`` reads this parser's results."""
        self._dests = []
        groups: dict[Optional[str], argparse._ArgumentGroup] = {None: parser.add_argument_group(title)}
        groups.update((key, parser.add_argument_group(title)) for key, title in self._sections.items())
        for section, group in groups.items():
            mine = [f for f in self.flags if f.section == section]
            for f in mine:
                if f.options:
                    action = group.add_argument(*f.options, default=argparse.SUPPRESS, **f.kwargs)
                    self._dests.append((action.dest, f, _NO_DEFAULT))
            for f in mine:
                if f.switch:
                    flag, value = f.switch
                    if f.options:
                        what = f"same as {f.options[0]} {_shown(value)}"
                    else:
                        doc = " ".join((self._field(f).description or "").split()).rstrip(".")
                        what = f"sets {f.dotted} to {_shown(value)}" + (f" ({doc})" if doc else "")
                    action = group.add_argument(flag, action="store_const", const=value, default=argparse.SUPPRESS,
                                                help=_plain(what))
                    self._dests.append((action.dest, f, value))

    def _field(self, f: SettingFlag) -> FieldInfo:
        model = self.model
        for key in f.path[:-1]:
            section = model.model_fields[key].annotation
            assert _is_section(section)  # a flag's path runs through sections only (__init__)
            model = section
        return model.model_fields[f.path[-1]]

    def given(self, namespace: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, Any]:
        """The settings the command line (or a setting's environment variable) sets, by dotted
        path: value flags, then switches (``--disable-retries`` wins over ``--retry-max-retries``),
        then the environment of settings no flag set. Call after ``add_to`` and ``parse_args``."""
        values = vars(namespace)
        out: dict[str, Any] = {}
        for dest, f, const in sorted(self._dests, key=lambda d: d[2] is not _NO_DEFAULT):
            if dest in values:
                out[f.dotted] = values[dest]
        for f in self.flags:
            if f.env is not None and f.dotted not in out and f.env in environ:
                out[f.dotted] = environ[f.env]
        return out

    def flag_of(self, path: str) -> Optional[str]:
        """The flag of the setting at dotted ``path``, None when no flag sets it."""
        f = self._by_path.get(path)
        return f.name if f is not None and (f.options or f.switch) else None

    def env_of(self, path: str) -> Optional[str]:
        """The environment variable of the setting at dotted ``path``, None when it has none."""
        f = self._by_path.get(path)
        return f.env if f is not None else None

    def argv(self, settings: BaseModel, exclude: tuple[str, ...] = ()) -> list[str]:
        """The value flags that give ``settings``: one per field set explicitly (pydantic's ``model_fields_set``,
        in a section too) and not None, in the model's order; none for a field left at its default, for one
        without a value flag, or for a dotted path in ``exclude``."""
        out: list[str] = []
        for f in self.flags:
            if not f.options or f.dotted in exclude:
                continue
            owner: BaseModel = settings
            for key in f.path[:-1]:
                owner = getattr(owner, key)
            if f.path[-1] not in owner.model_fields_set or f.path[0] not in settings.model_fields_set:
                continue
            value = getattr(owner, f.path[-1])
            if value is None:
                continue
            if isinstance(value, bool):
                out.append(f.options[0] if value else "--no-" + f.options[0].removeprefix("--"))
            elif isinstance(value, (tuple, list)):
                out += [f.options[0], *map(str, value)]
            else:
                out += [f.options[0], str(value)]
        return out


def flag(name: Optional[str] = None, *aliases: str, switch: Optional[tuple[str, Any]] = None,
         env: Optional[str] = None, takes_value: bool = True) -> dict:
    """Command-line metadata of one setting, for ``Field(json_schema_extra=flag(...))`` (``SettingsFlags`` reads
    it; a field without it gets its section's ``FLAG`` rule).

    Args:
        name: the flag that sets the field (e.g. ``"--health-failure-threshold"``), where the
            section's rule would give another name.
        aliases: more option strings of the same flag.
        switch: ``(flag, value)``: a flag without a value that sets the field to ``value``
            (``("--disable-retries", 1)``).
        env: an environment variable read when no flag sets the field.
        takes_value: False = no flag with a value (only ``switch``, or only ``env``).
    """
    meta: dict = {}
    if name is not None or not takes_value:
        meta["flag"] = name if takes_value else None
    if aliases:
        meta["aliases"] = list(aliases)
    if switch is not None:
        meta["switch"] = list(switch)
    if env is not None:
        meta["env"] = env
    return meta


def set_path(data: dict, dotted: str, value) -> None:
    """``data[a][b] = value`` for ``dotted`` ``a.b``, making (or replacing non-dict) sections."""
    *sections, leaf = dotted.split(".")
    for key in sections:
        if not isinstance(data.get(key), dict):
            data[key] = {}
        data = data[key]
    data[leaf] = value

