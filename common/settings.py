"""Settings of a binary from one dataclass: every field is a flag and an ``MMCAST_*`` environment variable.

A field made with ``setting()`` carries its help text, ``--help`` section, range and choices in its metadata. From
those alone:

- ``build_parser`` makes the command line: ``--kebab-name`` per field, grouped in sections, each help line showing
  the default and the variable; ``--version``; ``--print-config``.
- ``load`` resolves every value — a flag wins over its variable, a variable over the field's default — and
  builds the dataclass; text from a variable is converted exactly as text from a flag is.
- ``check_fields``, called first in the dataclass's ``__post_init__``, checks type, range and choice with a
  ``ValueError`` naming the setting, its value, its flag and what is allowed, so a dataclass built in code gets
  the same checks as one built from a command line.

Choices are matched case-insensitively and stored in their canonical spelling: ``MMCAST_LOG_LEVEL=INFO``,
``--log-level info`` and ``SchedulerConfig(log_level="Info")`` are the same setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

ENV_PREFIX = "MMCAST_"
LOG_LEVELS = ("debug", "info", "warning", "error")  # the JSON logs' "level" values, which setup_logging accepts
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")
EPILOG = (
    "Every flag is also an environment variable, named with it ([env MMCAST_...]); a flag wins over its variable, a "
    "variable over the default. Choices are case-insensitive. Lists are comma separated."
)


class SettingsError(ValueError):
    """A value that cannot be a setting; the message names the variable or setting, the value and the flag."""


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    section: str = "settings",
    min: float | None = None,
    max: float | None = None,
    choices: Sequence[str] | None = None,
    metavar: str | None = None,
) -> Any:
    """A dataclass field whose metadata generates its flag, its variable and its checks.

    ``default`` omitted: the setting is required (``load`` names the flag and variable when neither is given).
    A list default is copied per instance. ``choices`` are canonical spellings; input matches them ignoring case.
    """
    meta: dict[str, Any] = {"help": help, "section": section}
    if min is not None:
        meta["min"] = min
    if max is not None:
        meta["max"] = max
    if choices is not None:
        meta["choices"] = tuple(choices)
    if metavar is not None:
        meta["metavar"] = metavar
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_of(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def env_of(f: dataclasses.Field) -> str:
    return ENV_PREFIX + f.name.upper()


def default_of(f: dataclasses.Field) -> Any:
    """The field's default (a list default's fresh copy); ``dataclasses.MISSING`` for a required setting. Read by
    the generated documentation (scripts/gen_flag_docs.py) and the chart's checks as well as by ``load``."""
    return _default(f)


def _kind(f: dataclasses.Field) -> str:
    """int, float, bool, list or str, from the annotation (a string under ``from __future__ import annotations``)."""
    name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    name = name.split("[", 1)[0]
    return name if name in ("int", "float", "bool", "list") else "str"


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _canonical(value: Any, choices: Sequence[str]) -> str | None:
    """The choice ``value`` spells, ignoring case; None when it is none of them."""
    if not isinstance(value, str):
        return None
    folded = value.strip().casefold()
    return next((c for c in choices if c.casefold() == folded), None)


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _from_text(f: dataclasses.Field, text: str) -> Any:
    """The value ``text`` (from a flag or a variable) stands for. Raises ValueError with the reason alone."""
    kind = _kind(f)
    choices = f.metadata.get("choices")
    if choices:
        canonical = _canonical(text, choices)
        if canonical is None:
            raise ValueError(f"{text!r} is not one of {', '.join(choices)}")
        return canonical
    if kind == "int":
        try:
            return int(text.strip())
        except ValueError:
            raise ValueError(f"{text!r} is not an integer") from None
    if kind == "float":
        try:
            return float(text.strip())
        except ValueError:
            raise ValueError(f"{text!r} is not a number") from None
    if kind == "bool":
        folded = text.strip().lower()
        if folded in _TRUE:
            return True
        if folded in _FALSE:
            return False
        raise ValueError(f"{text!r} is not a boolean ({'/'.join(_TRUE)} or 0/false/no/off)")
    if kind == "list":
        return _split(text)
    return text


def _flag_type(f: dataclasses.Field) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return _from_text(f, text)
        except ValueError as exc:  # argparse prints "argument --flag: <reason>" and exits 2
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = _kind(f)
    return convert


def _shown(value: Any) -> str:
    if value is dataclasses.MISSING:
        return "required"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(map(str, value)) or "empty"
    if value == "":
        return "empty"
    return str(value)


def _help_line(f: dataclasses.Field) -> str:
    text = f"{f.metadata.get('help', '')} (default: {_shown(_default(f))}) [env {env_of(f)}]"
    return text.replace("%", "%%")  # argparse %-formats help strings


def _metavar(f: dataclasses.Field) -> str:
    if "metavar" in f.metadata:
        return f.metadata["metavar"]
    if "choices" in f.metadata:
        return "{" + ",".join(f.metadata["choices"]) + "}"
    return {"int": "N", "float": "X", "bool": "BOOL", "list": "A,B,..."}.get(_kind(f), "TEXT")


def package_version(distribution: str = "mmcast") -> str:
    """The installed distribution's version; from a source checkout's pyproject.toml when not installed."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        pass
    try:
        import tomllib

        with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as fh:
            return str(tomllib.load(fh)["project"]["version"]) + "+source"
    except (OSError, KeyError, ValueError):
        return "unknown"


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's layout, without breaking a flag named in a help text at its hyphens."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(
            " ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False
        )


def build_parser(cls: type, *, prog: str, description: str) -> argparse.ArgumentParser:
    """The command line of ``cls``: one flag per field in its section, plus ``--version`` and ``--print-config``."""
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=EPILOG, formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"{prog} {package_version()}")
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the settings this process would run with (flags over variables over defaults) as JSON and exit",
    )
    sections: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(cls):
        title = f.metadata.get("section", "settings")
        if title not in sections:
            sections[title] = parser.add_argument_group(title)
        kwargs: dict[str, Any] = {
            "dest": f.name,
            "type": _flag_type(f),
            "default": argparse.SUPPRESS,
            "metavar": _metavar(f),
            "help": _help_line(f),
        }
        if _kind(f) == "bool":  # a bare --flag means true; --flag false is accepted too
            kwargs.update(nargs="?", const=True)
        sections[title].add_argument(flag_of(f), **kwargs)
    return parser


def load(
    cls: type,
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Any:
    """``cls`` built from ``argv`` (flags), ``environ`` (``MMCAST_*``) and the defaults, in that order.

    A bad flag ends the process as argparse does (status 2, usage and reason on stderr); a bad variable, a
    missing required setting or a value the dataclass rejects raises ``ValueError`` naming it. ``--print-config``
    prints the result as JSON and exits 0.
    """
    environ = os.environ if environ is None else environ
    args = vars(parser.parse_args(argv))
    print_config = args.pop("print_config", False)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in args:
            values[f.name] = args[f.name]
        elif env_of(f) in environ:
            raw = environ[env_of(f)]
            try:
                values[f.name] = _from_text(f, raw)
            except ValueError as exc:
                raise SettingsError(f"{env_of(f)}={raw!r} ({flag_of(f)}): {exc}") from None
        elif _default(f) is dataclasses.MISSING:
            raise SettingsError(f"{f.name}: required ({flag_of(f)} {_metavar(f)} or {env_of(f)})")
    config = cls(**values)
    if print_config:
        print(json.dumps(dataclasses.asdict(config), indent=2, sort_keys=True))
        raise SystemExit(0)
    return config


def check_fields(config: Any) -> None:
    """Type, range and choice of every field, from its metadata; stores canonical choices, floats and lists.

    Called first in ``__post_init__`` (works on frozen dataclasses). Raises ``ValueError``:
    ``name=value (--flag): must be <what is allowed>``.
    """
    for f in dataclasses.fields(config):
        value = _checked(f, getattr(config, f.name))
        object.__setattr__(config, f.name, value)


def invalid(name: str, value: Any, allowed: str) -> ValueError:
    """The error of a setting outside what is allowed: its name, value and flag, and the rule."""
    return ValueError(f"{name}={value!r} (--{name.replace('_', '-')}): must be {allowed}")


def _checked(f: dataclasses.Field, value: Any) -> Any:
    kind, meta = _kind(f), f.metadata
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        raise invalid(f.name, value, "an integer")
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise invalid(f.name, value, "a number")
        value = float(value)
    if kind == "bool" and not isinstance(value, bool):
        raise invalid(f.name, value, "true or false")
    if kind == "list":
        value = _split(value) if isinstance(value, str) else list(value)
    if kind == "str" and not isinstance(value, str):
        raise invalid(f.name, value, "a string")
    if "choices" in meta:
        canonical = _canonical(value, meta["choices"])
        if canonical is None:
            raise invalid(f.name, value, f"one of {', '.join(meta['choices'])} (any case)")
        value = canonical
    lo, hi = meta.get("min"), meta.get("max")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        rule = f"in [{lo}, {hi}]" if lo is not None and hi is not None else f">= {lo}" if lo is not None else f"<= {hi}"
        raise invalid(f.name, value, rule)
    return value
