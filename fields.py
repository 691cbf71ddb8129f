"""Each config field's meaning, type and bound in one place, and the one mechanism that checks them.

A field is declared once, with what it means and what values it takes (MaxText's `configs/types.py` does the same
with pydantic's `Field`):

    steps: Annotated[int, Field("optimizer steps in total", ge=1)] = 1000

`--help` shows the text with its bound (tyro reads the `Field` as the field's documentation); every config class
derives from `Checked`, which checks each field's type and bound when the object is made, in one wording for all
programs: `--train.steps must be an integer >= 1, got 0`. Rules between fields (`train.seq_len` at most
`model.block_size`) are the class's own `cross_check()`, beside the fields they relate. A section with variants
that register themselves (the optimizer, the schedule) is a `Choice`.

This module is on the house's ground floor with errors.py: the model's config, the data's and the training's all
build on it, and it imports nothing of theirs. No JAX here: `python -m data.prepare` starts without it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import types
import typing
from typing import Any, Literal

from typing_extensions import Doc

from errors import ConfigError

_deferred = contextvars.ContextVar("deferred", default=False)


class Field(Doc):
    """A field's documentation and bound: ge/gt/le/lt (a closed or open end), `multiple_of`, `one_of` (names from a
    table, e.g. the sharding rules' presets), and `special` values allowed outside the range, each with its
    meaning (`{-1: "the rest of the devices"}`)."""

    def __init__(self, doc: str, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
                 lt: float | None = None, multiple_of: int | None = None, one_of: typing.Iterable[str] = (),
                 special: dict[Any, str] | None = None):
        self.ge, self.gt, self.le, self.lt, self.multiple_of = ge, gt, le, lt, multiple_of
        # `one_of` may be a live view (a Choice's registered variants, which grow as their modules are imported)
        self._one_of, self.special, self.doc = one_of, special or {}, doc

    @property
    def one_of(self) -> tuple[str, ...]:
        return tuple(self._one_of)

    @property
    def documentation(self) -> str:  # what tyro shows in --help (typing_extensions.Doc's attribute)
        bound = self.bound()
        return f"{self.doc} ({bound})" if bound else self.doc

    def __hash__(self) -> int:
        return hash(self.doc)

    def bound(self) -> str:
        """The range in words: ">= 1", "in [0, 1)", "> 0, a multiple of 128", ">= 1 or -1 (...)"."""
        if self.one_of:
            return f"one of {', '.join(self.one_of)}"
        low = (f"[{self.ge}" if self.ge is not None else f"({self.gt}" if self.gt is not None else None)
        high = (f"{self.le}]" if self.le is not None else f"{self.lt})" if self.lt is not None else None)
        if low and high:
            text = f"in {low}, {high}"
        else:
            text = {"[": ">= ", "(": "> "}[low[0]] + low[1:] if low else (
                {"]": "<= ", ")": "< "}[high[-1]] + high[:-1] if high else "")
        if self.multiple_of:
            text += f"{', ' if text else ''}a multiple of {self.multiple_of}"
        for value, meaning in self.special.items():
            text += f" or {value} ({meaning})"
        return text

    def admits(self, value) -> bool:
        if value in self.special:
            return True
        if self.one_of:
            return value in self.one_of
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt)
                and (not self.multiple_of or value % self.multiple_of == 0))


class Checked:
    """The base of every config class: `section` is the flag prefix of its fields (`train` for `--train.steps`;
    none for a program's top-level fields). Checks the fields' types and bounds, then the class's `cross_check()`."""

    section: typing.ClassVar[str] = ""

    def __init_subclass__(cls, section: str = "", **kwargs):
        super().__init_subclass__(**kwargs)
        if section or not hasattr(cls, "variants"):  # a Choice's variants keep their family's section
            cls.section = section

    def __post_init__(self):
        if not _deferred.get():
            self.check()

    def check(self) -> None:
        hints = typing.get_type_hints(type(self), include_extras=True)
        for f in dataclasses.fields(self):
            problem = field_problem(hints[f.name], getattr(self, f.name))
            if problem:
                raise ConfigError(f"{self.flag(f.name)} must be {problem}, got {getattr(self, f.name)!r}")
        self.cross_check()

    def cross_check(self) -> None:
        """Rules between fields (override): each raises a ConfigError naming the flags."""

    @classmethod
    def flag(cls, name: str) -> str:
        return f"--{cls.section}.{name}" if cls.section else f"--{name}"


class Choice(Checked):
    """A config section whose variants register themselves by name (Levanter's `OptimizerConfig.register_subclass`,
    torchtitan's optimizer factories): the family's base class declares what every variant shares, and a variant is
    one subclass, in one file, that names itself and adds its own fields:

        class OptimizerConfig(Choice, section="optim"): ...        # the family: lr, grad_clip (optim/base.py)
        class AdamWConfig(OptimizerConfig, choice="adamw"): ...    # + b1, b2, eps, weight_decay (optim/adamw.py)

    Every class of the family gets the field `name`, the variant's own name by default: config.json records it,
    `configs.from_dict` rebuilds the variant from it, and `--optim.name=muon` on the command line switches the
    variant before the other flags are read (configs/cli.py), so that `--optim.muon_lr` is a flag of Muon only.
    """

    variants: typing.ClassVar[dict[str, type]] = {}

    def __init_subclass__(cls, choice: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if choice is None:  # a family's base: its own registry
            cls.variants = {}
        else:
            cls.variants[choice] = cls
        # `name` first among the fields, with this class's name as its default (dataclass reads both from here)
        doc = Field(f"which {cls.section} (each variant adds fields of its own; `--{cls.section}.name=NAME --help`"
                    " lists them)", one_of=cls.variants.keys())
        cls.__annotations__ = {"name": typing.Annotated[str, doc], **cls.__dict__.get("__annotations__", {})}
        cls.name = choice or ""

    def cross_check(self) -> None:
        if self.variants.get(self.name) is not type(self):
            raise ConfigError(f"--{self.section}.name={self.name!r} is not a {type(self).__name__}")

    def switch(self, name: str) -> "Choice":
        """The variant `name` of this family, keeping the values of the fields the two share."""
        problem = field_problem(typing.get_type_hints(type(self), include_extras=True)["name"], name)
        if problem:  # the name field's own check, worded as every field's
            raise ConfigError(f"{self.flag('name')} must be {problem}, got {name!r}")
        variant = self.variants[name]
        shared = {f.name for f in dataclasses.fields(variant)} - {"name"}
        with deferred_checks():  # the flags still to come may make it valid
            return variant(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in shared})


def field_problem(hint, value) -> str | None:
    """What `value` should be but is not (an integer >= 1, ...), or None: the type first, then the `Field`'s bound."""
    typ, bounds = hint, ()
    if typing.get_origin(hint) is typing.Annotated:
        typ, *meta = typing.get_args(hint)
        bounds = [m for m in meta if isinstance(m, Field)]
    expected = _type_problem(typ, value)
    if expected:
        return expected + "".join(f" {b.bound()}" for b in bounds if b.bound())
    for b in bounds:
        if value is not None and not b.admits(value):
            return f"{_kind(typ)} {b.bound()}".strip()
    return None


def _type_problem(typ, value) -> str | None:
    args = typing.get_args(typ)
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (typ,) = [a for a in args if a is not type(None)]
        return _type_problem(typ, value)
    if typing.get_origin(typ) is Literal:
        return None if value in args else f"one of {', '.join(map(str, args))}"
    if typing.get_origin(typ) is tuple:
        ok = isinstance(value, tuple) and len(value) == len(args)
        ok = ok and all(_type_problem(a, v) is None for a, v in zip(args, value))
        return None if ok else f"{len(args)} {_kind(args[0]).split(' ', 1)[1]}s"
    if typ is bool:
        return None if isinstance(value, bool) else "true or false"
    if typ is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if typ is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return None if ok else "a finite number"
    if typ is str:
        return None if isinstance(value, str) else "a string"
    return None  # a nested config checks itself


def _kind(typ) -> str:
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        typ = next(a for a in typing.get_args(typ) if a is not type(None))
    return {int: "an integer", float: "a finite number"}.get(typ, "")


@contextlib.contextmanager
def deferred_checks():
    """Config objects made inside are not checked until `check_all`: while tyro builds them from flags, so that a
    bad value is our one line, not an error box around it."""
    token = _deferred.set(True)
    try:
        yield
    finally:
        _deferred.reset(token)


def check_all(cfg) -> None:
    """Checks a config and the configs nested in it, the innermost first."""
    for f in dataclasses.fields(cfg):
        if isinstance(getattr(cfg, f.name), Checked):
            check_all(getattr(cfg, f.name))
    cfg.check()
