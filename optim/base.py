"""What every optimizer of a run shares: its config family (`OptimizerConfig`, whose variants register themselves:
optim/adamw.py, optim/muon.py), the parameter facts the variants read, and what a built optimizer is.

A variant is one file: a subclass with its fields and three methods — its update rule, its peak learning rates by
group, and which group each parameter is in (docs/extending.md walks through adding one).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from fields import Choice, Field
from gpt2.layers import matrix_axes


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(Choice, section="optim"):
    """The optimizer: its update rule (the variant: --optim.name), global-norm clipping before it, and the learning
    rates that the schedule (--schedule.*) shapes over the run."""

    lr: Annotated[float, Field("peak learning rate (of every parameter, or of the default group)", gt=0)] = 6e-4
    grad_clip: Annotated[float, Field("clip the global gradient norm to this; 0 disables", ge=0)] = 1.0

    def update_rule(self, rates: dict[str, optax.Schedule], width_mult: float | None
                    ) -> optax.GradientTransformation:
        """The update after clipping, each group at its rate (`rates`: `peak_rates` on the run's schedule, the same
        schedules the step's report reads). `width_mult`: μP's m (None: the standard parametrization)."""
        raise NotImplementedError

    def peak_rates(self) -> dict[str, float]:
        """{group: peak learning rate}; "lr" is the default group (every parameter another group does not own)."""
        return {"lr": self.lr}

    def group_of(self, path: tuple[str, ...], variable: nnx.Variable) -> str:
        """The group (a key of `peak_rates`) of the parameter at `path`."""
        return "lr"

    def describe(self, params: nnx.State, width_mult: float | None = None) -> str:
        """The start-up line: each group's rate and what it holds (`width_mult`: μP's m, as update_rule's)."""
        counts = parameters_per_group(self, params)
        return "; ".join(f"{self.name} (lr {rate:g}) on {counts.get(group, 0):,} parameters"
                         for group, rate in self.peak_rates().items())


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """A built optimizer: the optax transformation the train step applies (clipping, the update rule, the spike
    guard around both); what it reports of each step it took, by metric name (each group's learning rate, the
    guard's skips), from the states before and after it: the train step logs whatever this returns; and the console
    notes a step's logged record deserves (a skipped update)."""

    tx: optax.GradientTransformationExtraArgs
    report: Callable[[optax.OptState, optax.OptState], dict[str, jax.Array]]
    notes: Callable[[dict], list[str]]


def by_path(params: nnx.State, leaf: Callable[[tuple, nnx.Variable], object]) -> nnx.State:
    """A tree like `params` with `leaf(path of names, variable)` in each variable."""

    def at(path, v: nnx.Variable) -> nnx.Variable:
        return v.replace(leaf(tuple(getattr(p, "key", p) for p in path), v))

    return jax.tree_util.tree_map_with_path(at, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def is_hidden_matrix(variable: nnx.Variable) -> bool:
    """Both dimensions grow with the width (μP's hidden weights; Muon's matrices): declared where the parameter is
    born (gpt2/layers.py `hidden_matrix`)."""
    return matrix_axes(variable) is not None


def decay_mask(params: nnx.State) -> nnx.State:
    """True for matmul weights and embeddings (GPT-2's 2-D weights); biases and norm scales are not decayed.

    Decided by name, not `ndim`: with scan_layers a LayerNorm scale is [L, D], and the fused QKV bias is
    stored as [3, H, K], yet both are vectors in GPT-2's terms.
    """
    return by_path(params, lambda path, v: path[-1] in ("kernel", "embedding"))


def parameters_per_group(optimizer: OptimizerConfig, params: nnx.State) -> dict[str, int]:
    """How many parameters each group holds (for the start-up line)."""
    groups = by_path(params, optimizer.group_of)  # the paths the partition sees
    counts: dict[str, int] = {}
    for (_, group), (_, v) in zip(nnx.to_flat_state(groups), nnx.to_flat_state(params)):
        counts[group.get_value()] = counts.get(group.get_value(), 0) + v.get_value().size
    return counts


def applied_updates(state: optax.OptState) -> jax.Array:
    """How many updates the optimizer state has applied: its own step count (optax's `count`, which every
    stateful schedule and Adam keep, all equal), so a schedule read at it is the rate the next update uses."""
    (_, count), *_ = optax.tree_utils.tree_get_all_with_path(state, "count")
    return count


def all_finite(tree) -> jax.Array:
    """bool[]: every element of every floating leaf is finite (one fused reduction on the devices)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves]))
