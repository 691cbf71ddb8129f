"""Logical-axis sharding: the one table that maps logical axis names onto the device mesh.

Modules only ever name *logical* axes (on parameters, via `out_sharding` metadata; on activations, via
`GPT2._constrain`). Which mesh axis each logical axis is split over is decided here and nowhere else.

Mesh axes: `data` (pure data parallel: params replicated), `fsdp` (data parallel with params, grads and
optimizer state sharded, ZeRO-3 style), `tensor` (Megatron tensor parallel over heads / mlp / vocab).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gpt2.config import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")

# Parameter axes: vocab, embed, positions, qkv (the 3 of fused QKV), heads, head_dim, mlp, layers.
# Activation axes: batch, seq, act_embed, act_vocab.
ACTIVATION_AXES = ("batch", "seq", "act_embed", "act_vocab")
LOGICAL_AXES = ("vocab", "embed", "positions", "qkv", "heads", "head_dim", "mlp", "layers", *ACTIVATION_AXES)

MeshAxes = str | tuple[str, ...] | None

BATCH = ("data", "fsdp")  # the global batch is split over every data-parallel axis

# THE table. Unlisted logical axes are replicated.
RULES: dict[str, dict[str, MeshAxes]] = {
    "dp": {"batch": BATCH},
    "fsdp": {"batch": BATCH, "embed": "fsdp"},
    "tp": {"batch": BATCH, "heads": "tensor", "mlp": "tensor", "vocab": "tensor", "act_vocab": "tensor"},
    "fsdp_tp": {
        "batch": BATCH, "embed": "fsdp",
        "heads": "tensor", "mlp": "tensor", "vocab": "tensor", "act_vocab": "tensor",
    },
}


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """A validated logical -> mesh mapping (hashable, so it can live in a module's static graph)."""

    name: str
    table: tuple[tuple[str, MeshAxes], ...]

    @classmethod
    def preset(cls, name: str) -> "ShardingRules":
        if name not in RULES:
            raise ConfigError(f"unknown sharding rules preset {name!r}; choose one of {sorted(RULES)}")
        return cls.from_dict(name, RULES[name])

    @classmethod
    def from_dict(cls, name: str, table: dict[str, MeshAxes]) -> "ShardingRules":
        for logical, mesh_axes in table.items():
            if logical not in LOGICAL_AXES:
                raise ConfigError(f"rules {name!r}: unknown logical axis {logical!r}; known: {LOGICAL_AXES}")
            for axis in _as_tuple(mesh_axes):
                if axis not in MESH_AXES:
                    raise ConfigError(
                        f"rules {name!r}: logical axis {logical!r} maps to unknown mesh axis {axis!r};"
                        f" mesh axes are {MESH_AXES}"
                    )
        return cls(name, tuple(table.items()))

    def flax_rules(self) -> tuple[tuple[str, MeshAxes], ...]:
        """Every logical axis with its mesh axes, in the form `nnx.logical_axis_rules` takes."""
        return tuple((a, self.mesh_axes(a)) for a in LOGICAL_AXES)

    def mesh_axes(self, logical: str | None) -> MeshAxes:
        return dict(self.table).get(logical) if logical is not None else None

    def replica_batch_axes(self) -> tuple[str, ...]:
        """The leading mesh axes of the batch over which no parameter is split: along them every device holds
        whole parameters (and whole gradients), so a gradient can be summed where it is computed and reduced once
        (trainer/program/train_program.py's gradient accumulation). dp and tp: data and fsdp; fsdp and fsdp_tp: data."""
        split = {a for logical, axes in self.table if logical not in ACTIVATION_AXES for a in _as_tuple(axes)}
        batch = _as_tuple(self.mesh_axes("batch"))
        leading = next((i for i, a in enumerate(batch) if a in split), len(batch))
        return batch[:leading]

    def with_batch(self, mesh_axes: tuple[str, ...]) -> "ShardingRules":
        """These rules with the batch split over `mesh_axes` only (none: replicated)."""
        table = {**dict(self.table), "batch": mesh_axes or None}
        return ShardingRules.from_dict(f"{self.name} (batch over {mesh_axes})", table)

    def spec(self, logical_axes: Sequence[str | None]) -> PartitionSpec:
        """PartitionSpec for an array whose dims have these logical names.

        Raises if two dims would be split over the same mesh axis (JAX forbids it, and it is always a
        mistake in the table).
        """
        used: dict[str, str] = {}
        out = []
        for logical in logical_axes:
            mesh_axes = self.mesh_axes(logical)
            for axis in _as_tuple(mesh_axes):
                if axis in used:
                    raise ConfigError(
                        f"rules {self.name!r}: logical axes {used[axis]!r} and {logical!r} of one array"
                        f" {tuple(logical_axes)} both map to mesh axis {axis!r}"
                    )
                used[axis] = logical
            out.append(mesh_axes)
        return PartitionSpec(*out)


def _as_tuple(mesh_axes: MeshAxes) -> tuple[str, ...]:
    if mesh_axes is None:
        return ()
    return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)


def logical_axes_of(variable) -> tuple[str | None, ...]:
    """The logical names attached to an nnx.Variable (() for unannotated scalars)."""
    return tuple(variable.get_metadata().get("out_sharding") or ())


def named_shardings(state, mesh: Mesh, rules: ShardingRules):
    """NamedSharding for every Variable in an nnx.State, from its logical names and the table.

    Raises if a dimension is not divisible by the mesh axes it is split over (naming the parameter).
    """
    def one(path, v):
        logical = logical_axes_of(v)
        spec = rules.spec(logical)
        for dim, (size, axes) in enumerate(zip(v.shape, spec)):
            parts = int(np.prod([mesh.shape[a] for a in _as_tuple(axes)]))
            if size % parts:
                name = ".".join(str(getattr(k, "key", k)) for k in path)
                raise ConfigError(
                    f"{name}: dimension {dim} ({logical[dim]}, size {size}) cannot be split {parts} ways over"
                    f" mesh axes {axes!r} (rules {rules.name!r}); pad it (model.pad_vocab_to=128 for the"
                    " vocabulary) or choose other mesh sizes or rules"
                )
        return v.replace(NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh, rules: ShardingRules, ndim: int = 2) -> NamedSharding:
    """Sharding of a [..., B, T] batch: B over the batch mesh axes, leading dims (e.g. K steps) replicated."""
    spec = rules.spec(("batch", "seq"))
    return NamedSharding(mesh, PartitionSpec(*([None] * (ndim - 2)), *spec))
