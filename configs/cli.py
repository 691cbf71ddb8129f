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
import types as types_module
import typing
from typing import TypeVar

import tyro

from errors import ConfigError, fail
from fields import Choice, check_all, deferred_checks

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
    try:
        default = _chosen_variants(default, argv)
    except ConfigError as e:
        fail(str(e))
    shape = default if default is not None else cls  # a chosen variant's fields are flags too
    argv = _bare_booleans(shape, argv)
    kw = dict(default=default, args=argv, prog=prog, description=description, use_underscores=True)
    if "-h" in argv or "--help" in argv:
        return tyro.cli(cls, **kw)
    unknown = _unknown_flags(shape, argv) or _mistyped_value(shape, argv)
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


def _chosen_variants(default, argv: list[str]):
    """`default` with each `--SECTION.name=NAME` of a registered choice (fields.Choice: `--optim.name=muon`,
    `--schedule.name=wsd`) switched to that variant, so that its own fields parse as flags."""
    for key, value in _flag_values(argv):
        section, _, name = key.rpartition(".")
        current = getattr(default, section, None) if default is not None and section else None
        if name == "name" and isinstance(current, Choice) and value is not None and value != current.name:
            default = dataclasses.replace(default, **{section: current.switch(value)})
    return default


def _flag_values(argv: list[str]):
    """(dotted key with underscores, value or None) of each `--key=value` / `--key value` / `--key` in argv."""
    for i, arg in enumerate(argv):
        if not arg.startswith("--"):
            continue
        key, eq, value = arg[2:].partition("=")
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
        yield key.replace("-", "_"), value


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


def _fields(config) -> list[tuple[str, object]]:
    """(name, type) of a config class's fields, or an instance's, whose nested sections are the types they hold (a
    Choice section: its chosen variant, not the family's base)."""
    hints = typing.get_type_hints(config if isinstance(config, type) else type(config), include_extras=True)
    out = []
    for f in dataclasses.fields(config):
        typ = hints[f.name]
        if not isinstance(config, type) and dataclasses.is_dataclass(getattr(config, f.name)):
            typ = getattr(config, f.name)
        out.append((f.name, typ))
    return out


def _plain(typ):
    """A field's type without its Annotated documentation."""
    return typing.get_args(typ)[0] if typing.get_origin(typ) is typing.Annotated else typ


def boolean_flags(config, prefix: str = "") -> set[str]:
    """Dotted names of the boolean fields of nested dataclasses ("log.progress", "all", ...)."""
    out = set()
    for name, typ in _fields(config):
        if _plain(typ) is bool:
            out.add(prefix + name)
        elif dataclasses.is_dataclass(typ):
            out |= boolean_flags(typ, f"{prefix}{name}.")
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


def flag_names(config, prefix: str = "") -> dict[str, list[str]]:
    """{section: [field names]} for nested dataclasses; section "" is the top level."""
    sections: dict[str, list[str]] = {prefix.rstrip("."): []}
    for name, typ in _fields(config):
        sections[prefix.rstrip(".")].append(name)
        if dataclasses.is_dataclass(typ):
            sections.update(flag_names(typ, f"{prefix}{name}."))
    return sections


def _unknown_flags(config, argv: list[str]) -> str | None:
    """A message for the first --flag that names no field, with the nearest flag of any section (`--lr`: did you
    mean --optim.lr?) and the valid names of its own."""
    sections = flag_names(config)
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
        variant = _variant_owning(config, section, name)
        hint = _nearest_flag(sections, section, name)
        hint = (f" (a field of --{section}.name={variant})" if variant else f" (did you mean {hint}?)" if hint
                else "")
        valid = sections.get(section)
        if valid is None:
            choices = sorted(s for s in sections if s)
            return f"unknown config section {section!r} in {arg!r}{hint}; sections are {choices}"
        where = f"{section}." if section else ""
        return f"unknown config key --{where}{name}{hint}; valid keys of {section or 'the top level'}: {valid}"
    return None


def _variant_owning(config, section: str, name: str) -> str | None:
    """The variant of the registered choice at `section` (`--optim.name=muon`) whose field `name` is, if another's."""
    node = config
    for part in filter(None, section.split(".")):
        node = getattr(node, part, None) if not isinstance(node, type) else None
    if not isinstance(node, Choice):
        return None
    return next((v for v, cls in node.variants.items() if name in {f.name for f in dataclasses.fields(cls)}), None)


def _nearest_flag(sections: dict[str, list[str]], section: str, name: str) -> str | None:
    """The flag a mistyped `--section.name` most likely meant: a close name in its own section, else the same name
    in another section (`--steps` -> --train.steps, `--optim.warmup_steps` -> --schedule.warmup_steps), else a close
    name anywhere."""
    dotted = lambda s, n: f"--{s + '.' if s else ''}{n}"  # noqa: E731
    close = difflib.get_close_matches(name, sections.get(section, []), n=1)
    if close:
        return dotted(section, close[0])
    exact = [s for s, names in sections.items() if name in names and s != section]
    if exact:
        return dotted(exact[0], name)
    everywhere = {dotted(s, n): n for s, names in sections.items() for n in names}
    close = difflib.get_close_matches(name, list(everywhere.values()), n=1)
    return next((flag for flag, n in everywhere.items() if close and n == close[0]), None)


def _mistyped_value(config, argv: list[str]) -> str | None:
    """One line for the first `--flag=value` whose value is not of the field's type (an integer, a number), before
    tyro's own message (Python's "invalid literal for int() with base 10")."""
    types = {}
    for section, names in flag_names(config).items():
        node = config
        for part in filter(None, section.split(".")):
            node = dict(_fields(node))[part]
        types.update({f"{section + '.' if section else ''}{n}": _plain(t) for n, t in _fields(node)})
    for key, value in _flag_values(argv):
        typ = types.get(key)
        optional = typing.get_origin(typ) in (typing.Union, types_module.UnionType)
        kinds = set(typing.get_args(typ)) - {type(None)} if optional else {typ}
        if value is None or len(kinds) != 1 or not kinds <= {int, float} or (optional and value == "None"):
            continue
        (number,) = kinds
        try:
            number(value)
        except ValueError:
            return f"--{key} takes {'an integer' if number is int else 'a number'}, got {value!r}"
    return None
