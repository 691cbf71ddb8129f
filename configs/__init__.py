"""Named training presets. Each `configs/<name>.py` defines `CONFIG`; `load(name)` returns it."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import typing
from pathlib import Path

from errors import ConfigError

_NOT_PRESETS = {"base", "cli", "eval", "fields", "plan"}
PRESETS = sorted(
    m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]) if m.name not in _NOT_PRESETS
)
DEFAULT = "shakespeare_cpu"


def load(name: str):
    """The preset `configs/<name>.py`'s Config."""
    if name not in PRESETS:
        raise ConfigError(f"unknown config {name!r}; choose one of {PRESETS}")
    return importlib.import_module(f"configs.{name}").CONFIG


def extend(base, **changes):
    """`base` with `changes`: a field's new value, or for a nested config a dict of its changed fields
    (`model=dict(n_layer=24)`). A preset that extends another lists only what differs, as nanoGPT's config files
    do."""
    nested = {k: dataclasses.replace(getattr(base, k), **v) for k, v in changes.items() if isinstance(v, dict)}
    return dataclasses.replace(base, **{**changes, **nested})


def from_dict(d: dict, cls: type | None = None):
    """A config dataclass (default: Config) from its `dataclasses.asdict` form (e.g. the copy in a checkpoint)."""
    if cls is None:
        from configs.base import Config  # imported here: `configs.cli` stays free of JAX

        cls = Config
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in d:
            value = d[f.name]
            if dataclasses.is_dataclass(hints[f.name]):
                value = from_dict(value, hints[f.name])
            elif typing.get_origin(hints[f.name]) is tuple:  # JSON has no tuples
                value = tuple(value)
            kwargs[f.name] = value
    return cls(**kwargs)
