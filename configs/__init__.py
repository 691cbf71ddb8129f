"""Named training presets. Each `configs/<name>.py` defines `CONFIG`; `load(name)` returns it."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import typing
from pathlib import Path

from errors import ConfigError
from fields import Choice

_NOT_PRESETS = {"base", "cli", "eval", "plan"}
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
    (`model=dict(n_layer=24)`; `optim=dict(name="muon")` switches the variant, keeping the fields it shares). A
    preset that extends another lists only what differs, as nanoGPT's config files do."""

    def changed(section, fields: dict):
        if "name" in fields and isinstance(section, Choice):
            section = section.switch(fields["name"])
        return dataclasses.replace(section, **fields)

    nested = {k: changed(getattr(base, k), v) for k, v in changes.items() if isinstance(v, dict)}
    return dataclasses.replace(base, **{**changes, **nested})


def from_dict(d: dict, cls: type | None = None):
    """A config dataclass (default: Config) from its `dataclasses.asdict` form (e.g. the copy in a checkpoint)."""
    if cls is None:
        from configs.base import Config  # imported here: `configs.cli` stays free of JAX

        cls, d = Config, _as_today(d)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in d:
            value = d[f.name]
            if dataclasses.is_dataclass(hints[f.name]):
                variant = hints[f.name]
                if issubclass(variant, Choice):  # the variant the record names, else the field's default one
                    variant = variant.variants.get(value.get("name"), type(f.default))
                value = from_dict(value, variant)
            elif typing.get_origin(hints[f.name]) is tuple:  # JSON has no tuples
                value = tuple(value)
            kwargs[f.name] = value
    return cls(**kwargs)


def _as_today(d: dict) -> dict:
    """A recorded Config (a checkpoint's config.json) in today's layout: records from before the schedule had a
    section of its own keep its fields in optim (and mean the cosine)."""
    if "schedule" in d or "optim" not in d:
        return d
    moved = ("warmup_steps", "decay_steps", "min_lr_ratio")
    optim = {k: v for k, v in d["optim"].items() if k not in moved}
    return {**d, "optim": optim, "schedule": {"name": "cosine", **{k: d["optim"][k] for k in moved if k in d["optim"]}}}
