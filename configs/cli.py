"""Command-line parsing of frozen config dataclasses with tyro, and errors that fit on one line.

`--model.n_layer=6`, `--model.n_layer 6` and `--model.n-layer 6` all work. tyro reports problems in a
multi-line box; a user running on 256 hosts wants one line naming the flag, so we condense it and, for an
unknown flag, list the valid ones of its section.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import io
import re
import sys
import typing
from typing import TypeVar

import tyro

from configs.fields import check_all, deferred_checks
from errors import ConfigError, fail

T = TypeVar("T")

_BOX = re.compile(r"[│╭╮╰╯+|]+")


def parse(cls: type[T], argv: list[str] | None, *, default: T | None = None, presets: bool = False, prog: str,
          description: str | None = None) -> T:
    """Parses argv into `cls` (starting from `default`); exits with status 2 and one line on bad input.

    Booleans are tyro's switches (`--log.progress` / `--log.no_progress`, `--all`, `--no-wandb`); the value
    forms `--log.progress=false`, `--log.progress false` (true/false/1/0/yes/no, any case) work too.
    `presets`: `--config NAME` picks the preset (configs/NAME.py) the other flags override.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if presets:
        default, argv = _preset(cls, argv)
        description = f"{description or ''}\n{_presets_help()}"
    argv = _bare_booleans(cls, argv)
    kw = dict(default=default, args=argv, prog=prog, description=description, use_underscores=True)
    if "-h" in argv or "--help" in argv:
        return tyro.cli(cls, **kw)
    unknown = _unknown_flags(cls, argv)
    if unknown:
        fail(unknown)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), deferred_checks():  # tyro would wrap our one line in a box
            cfg = tyro.cli(cls, **kw)
    except SystemExit as e:
        if e.code in (0, None):
            raise
        fail(_condense(stderr.getvalue()))
    try:
        check_all(cfg)
    except ConfigError as e:
        fail(str(e))
    return cfg


def _preset(cls: type[T], argv: list[str]) -> tuple[T, list[str]]:
    """(the preset `--config NAME` names, or the default one, as a `cls`; argv without the flag). `cls` may extend
    the presets' class with fields of its own (plan.py's options), which keep their defaults."""
    import configs  # the presets import the model's config, and so JAX: only programs that have presets pay

    name, rest = preset_name(argv)
    preset = configs.load(name)
    with deferred_checks():  # a default to start from, with plan.py's --topology still to come: checked once parsed
        return cls(**{f.name: getattr(preset, f.name) for f in dataclasses.fields(preset)}), rest


def preset_name(argv: list[str]) -> tuple[str, list[str]]:
    """(the preset `--config NAME` names, or the default one; argv without the flag)."""
    import configs

    name, rest = configs.DEFAULT, []
    args = iter(argv)
    for arg in args:
        if arg == "--config":
            name = next(args, None)
            if name is None:
                fail(f"--config needs a preset name: {', '.join(configs.PRESETS)}")
        elif arg.startswith("--config="):
            name = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return name, rest


def _presets_help() -> str:
    import configs

    return (f"Before the config fields below:\n  --config NAME     the preset the other flags override:"
            f" {', '.join(configs.PRESETS)} (default {configs.DEFAULT})\n")


TRUE, FALSE = {"true", "1", "yes"}, {"false", "0", "no"}


def _bare_booleans(cls: type, argv: list[str]) -> list[str]:
    """`--x.flag=false` / `--x.flag false` -> `--x.no_flag`, `--x.flag=true` -> `--x.flag` for boolean fields."""
    booleans = boolean_flags(cls)
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        key, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        key = key.replace("-", "_")
        if key in booleans and not eq and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            value, eq, i = argv[i + 1], "=", i + 1  # the space-separated form (these programs take no positionals)
        if key in booleans and eq and value.lower() not in TRUE | FALSE:
            section, _, name = key.rpartition(".")
            fail(f"--{key} takes true or false (1/0, yes/no), got {value!r}; or the switches --{key} /"
                 f" --{section + '.' if section else ''}no_{name}")
        if key in booleans and eq and value.lower() in TRUE | FALSE:
            section, _, name = key.rpartition(".")
            arg = f"--{key}" if value.lower() in TRUE else f"--{section + '.' if section else ''}no_{name}"
        out.append(arg)
        i += 1
    return out


def boolean_flags(cls: type, prefix: str = "") -> set[str]:
    """Dotted names of the boolean fields of nested dataclasses ("log.progress", "all", ...)."""
    hints, out = typing.get_type_hints(cls), set()
    for f in dataclasses.fields(cls):
        if hints[f.name] is bool:
            out.add(prefix + f.name)
        elif dataclasses.is_dataclass(hints[f.name]):
            out |= boolean_flags(hints[f.name], f"{prefix}{f.name}.")
    return out


def _condense(text: str) -> str:
    """The message of tyro's error box as one line, without its title and the help text after it; "Error parsing
    --flag: why" as "--flag: why". In a terminal the box is drawn (its title in the top border); without one, the
    title is a line of its own above a rule of dashes."""
    paragraphs, current = [], []
    for raw in text.splitlines():
        line = _BOX.sub(" ", raw).strip()  # without the box's sides
        if re.search(r"[─-]{3,}", line):  # a border or a rule
            paragraphs, current = paragraphs + [current] if current else paragraphs, []
        elif line:
            current.append(line)
    paragraphs += [current] if current else []
    if "╭" not in text and len(paragraphs) > 1:
        paragraphs = paragraphs[1:]  # the title
    message = " ".join(paragraphs[0]) if paragraphs else text.strip()
    return re.sub(r"^Error parsing (--\S+): ", r"\1: ", message)


def flag_names(cls: type, prefix: str = "") -> dict[str, list[str]]:
    """{section: [field names]} for nested dataclasses; section "" is the top level."""
    sections: dict[str, list[str]] = {prefix.rstrip("."): []}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        sections[prefix.rstrip(".")].append(f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            sections.update(flag_names(hints[f.name], f"{prefix}{f.name}."))
    return sections


def _unknown_flags(cls: type, argv: list[str]) -> str | None:
    """A message for the first --flag that names no field, with the valid names of its section."""
    sections = flag_names(cls)
    for arg in argv:
        if not arg.startswith("--"):
            continue
        key = arg[2:].split("=", 1)[0].replace("-", "_")
        section, _, name = key.rpartition(".")
        if name.startswith("no_") and name[3:] in sections.get(section, ()):
            continue  # tyro's negated switch of a boolean
        if section in sections and name in sections[section]:
            continue
        if key in sections:  # a whole section given as one flag
            continue
        valid = sections.get(section)
        if valid is None:
            choices = sorted(s for s in sections if s)
            return f"unknown config section {section!r} in {arg!r}; sections are {choices}"
        close = difflib.get_close_matches(name, valid, n=1)
        hint = f" (did you mean {section + '.' if section else ''}{close[0]}?)" if close else ""
        where = f"{section}." if section else ""
        return f"unknown config key --{where}{name}{hint}; valid keys of {section or 'the top level'}: {valid}"
    return None
