"""The spike guard, an optax transformation: it wraps the optimizer and skips a step whose loss or gradient norm is
an outlier, keeping the running statistics that decide it in the optimizer state (so a checkpoint carries them and
a resume stays exact). Levanter's `optim/skipstep.py` is the same idea.

A step is judged on numbers it computes anyway (its loss, passed in as `update(..., loss=loss)`, and the gradient
norm before clipping). The loss falls throughout training, fast at first, so a z-score against a plain moving mean
mistakes the trend for spread (early on, a loss at the initial level scored under 2σ). Each quantity is therefore
judged by its residual against a fast-moving level (the trend), standardized by the moving mean and variance of
past residuals: a steady trend only shifts the residuals' mean. A skipped step gives zero updates, keeps the
wrapped optimizer's state (its count, and so its learning-rate schedule, moves with applied steps only) and moves
none of the statistics, so one spike cannot raise the bar for the next. GuardConfig (below) holds the
thresholds.

The transformation is always in the chain, so the train state has one structure whether the guard is on or off
(and a run may switch it at a resume); with `guard.skip_spikes` off it only passes the update through.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fields import Checked, Field
from optim.base import all_finite

@dataclasses.dataclass(frozen=True)
class GuardConfig(Checked, section="guard"):
    """Numerical safety beyond the check that always runs (a non-finite train state is never saved).

    The spike guard skips, inside the scanned train call, the update of a step whose loss or gradient norm is
    an outlier: its residual against the quantity's moving level (the trend) lies more than `z_loss` /
    `z_grad_norm` standard deviations above the residuals of the steps it accepted (llm.c's `-sl` / `-sg`
    outlier skip, made robust to the falling trend of the loss; below). A skipped step
    leaves the parameters and optimizer state unchanged but still consumes its batch and its step number (the
    optimizer's own count, and so the learning-rate schedule, moves with applied updates only). A step with a
    non-finite loss or gradient norm, or whose update would make the state non-finite, is always skipped while
    the guard is on. The running statistics are part of the checkpoint.
    """

    skip_spikes: Annotated[bool, Field("turn the spike guard on")] = False
    z_loss: Annotated[float, Field("loss outlier threshold in standard deviations", gt=0)] = 6.0
    z_grad_norm: Annotated[float, Field(
        "gradient-norm (before clipping) outlier threshold in standard deviations", gt=0)] = 6.0
    decay: Annotated[float, Field(
        "decay of the residuals' moving mean and variance (0.99: about the last 100 accepted steps)", gt=0,
        lt=1)] = 0.99
    warmup: Annotated[int, Field(
        "accepted steps before the thresholds apply (the statistics need a few residuals). As many skipped steps"
        " in a row restart the statistics (a new level, not a spike) and this warm-up", ge=3)] = 100
    rollback_after: Annotated[int | None, Field(
        "after this many consecutive skipped steps, or at once when the train state is not finite, restore the"
        " newest checkpoint and continue with the data guard.rollback_skip batches past the ones the abandoned"
        " steps read (PaLM, Chowdhery et al. 2022, section 5.1). None: no rollback; a non-finite state then stops"
        " the run", ge=1)] = None
    rollback_skip: Annotated[int, Field(
        "batches skipped after the abandoned steps' batches at a rollback", ge=0)] = 100
    max_rollbacks: Annotated[int, Field("rollbacks one run may take; one more stops the run", ge=1)] = 3


LEVEL_DECAY = 0.9  # the level follows the trend within ~10 accepted steps

# per quantity q in (loss, grad): "q_level" (moving level), "q_m1", "q_m2" (moving averages of the residual
# and its square), f32[]; "accepted", "skipped": i32[] step counts; "streak": i32[] skipped steps in a row
GuardStats = dict
QUANTITIES = ("loss", "grad")


class SpikeGuardState(NamedTuple):
    inner: Any  # the wrapped optimizer's state
    stats: GuardStats


def spike_guard(cfg: GuardConfig, inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """`inner`, with a step skipped (zero updates, `inner`'s state kept) when its loss or gradient norm is an
    outlier, or when it or its update is not finite; `update` takes the step's `loss`."""

    def init(params) -> SpikeGuardState:
        return SpikeGuardState(inner.init(params), init_stats())

    def update(grads, state: SpikeGuardState, params=None, *, loss, **extra):
        updates, inner_state = inner.update(grads, state.inner, params, **extra)
        if not cfg.skip_spikes:
            return updates, SpikeGuardState(inner_state, state.stats)
        with jax.named_scope("spike_guard"):
            grad_norm = optax.tree.norm(grads)
            finite = (jnp.isfinite(loss) & jnp.isfinite(grad_norm)
                      & all_finite((optax.apply_updates(params, updates), inner_state)))
            skip = ~finite | is_outlier(cfg, state.stats, loss, grad_norm)
            updates = jax.tree.map(lambda u: jnp.where(skip, jnp.zeros_like(u), u), updates)
            inner_state = jax.tree.map(lambda old, new: jnp.where(skip, old, new), state.inner, inner_state)
            return updates, SpikeGuardState(inner_state, update_stats(cfg, state.stats, loss, grad_norm, skip))

    return optax.GradientTransformationExtraArgs(init, update)


def step_report(before: SpikeGuardState, after: SpikeGuardState) -> dict[str, jax.Array]:
    """What a step's update did: skipped (0/1), and the streak of skipped steps it ends."""
    return {"skipped": after.stats["skipped"] - before.stats["skipped"], "streak": after.stats["streak"]}


def from_state_format_1(abstract_state: dict, had_guard: bool, replicated) -> tuple[dict, Any]:
    """Checkpoints written before the guard's statistics moved into the optimizer state (state format 1) hold the
    optimizer's state alone as "opt_state" and, from a run with the guard on, its statistics as a top-level "guard"
    (fresh ones, as for a run that had it off, otherwise): (what to restore such a checkpoint into, given this run's
    abstract train state; how to make the restored tree this run's). `replicated`: the statistics' sharding."""
    target = {**abstract_state, "opt_state": abstract_state["opt_state"].inner}
    if had_guard:
        target["guard"] = jax.tree.map(lambda a: a.update(sharding=replicated), jax.eval_shape(init_stats))

    def upgrade(old: dict) -> dict:
        stats = old.pop("guard", None)
        if stats is None:
            stats = jax.device_put(init_stats(), replicated)
        return {**old, "opt_state": SpikeGuardState(old["opt_state"], stats)}

    return target, upgrade


def guard_notes(cfg: GuardConfig, record: dict) -> list[str]:
    """What the console says of a step's logged record (`step_report`'s skipped and streak among its metrics)."""
    if not record.get("skipped"):
        return []
    notes = [f"update skipped by the spike guard (loss {record['loss']}, grad_norm {record['grad_norm']})"]
    if record.get("streak") == cfg.warmup:
        notes.append(f"{cfg.warmup} steps in a row skipped (guard.warmup): the loss or gradient norm moved to a new"
                     " level; the spike guard restarts its statistics")
    return notes


def without_streak(state: SpikeGuardState) -> SpikeGuardState:
    """After a rollback the new data gets a fresh count (the checkpoint may have been saved mid-streak)."""
    return state._replace(stats=state.stats | {"streak": jnp.zeros_like(state.stats["streak"])})


def init_stats() -> GuardStats:
    # host zeros: the optimizer's init places them (tracing a constant would compile a program per dtype)
    stats = {f"{q}_{k}": np.zeros((), np.float32) for q in QUANTITIES for k in ("level", "m1", "m2")}
    return stats | {k: np.zeros((), np.int32) for k in ("accepted", "skipped", "streak")}


def is_outlier(cfg: GuardConfig, stats: GuardStats, loss: jax.Array, grad_norm: jax.Array) -> jax.Array:
    """bool[]: the step's loss or gradient norm lies above its threshold (only once the guard has armed)."""
    # residuals recorded so far: every accepted step but the first, which only seeds the level; the moving
    # averages start at 0, so divide by the weight they have accumulated (Adam's bias correction)
    weight = 1 - jnp.power(cfg.decay, jnp.maximum(stats["accepted"] - 1, 1).astype(jnp.float32))

    def z(q, x):  # one-sided: a loss falling faster than usual is no reason to skip
        mean = stats[f"{q}_m1"] / weight
        var = jnp.maximum(stats[f"{q}_m2"] / weight - mean**2, 0.0)
        # a spread of at least 0.1 % of the level: a few near-identical residuals must not make noise a spike
        std = jnp.maximum(jnp.sqrt(var), 1e-3 * jnp.abs(stats[f"{q}_level"]) + 1e-6)
        return (x - stats[f"{q}_level"] - mean) / std

    armed = stats["accepted"] >= cfg.warmup
    return armed & ((z("loss", loss) > cfg.z_loss) | (z("grad", grad_norm) > cfg.z_grad_norm))


def update_stats(cfg: GuardConfig, stats: GuardStats, loss: jax.Array, grad_norm: jax.Array,
                 skipped: jax.Array) -> GuardStats:
    """The statistics after a step: the level and moments move with an accepted step only (the first one
    seeds the level); the counters move with every step."""
    first, new = stats["accepted"] == 0, {}
    for q, x in (("loss", loss), ("grad", grad_norm)):
        level, m1, m2 = stats[f"{q}_level"], stats[f"{q}_m1"], stats[f"{q}_m2"]
        r = x - level
        moved = {
            "level": jnp.where(first, x, LEVEL_DECAY * level + (1 - LEVEL_DECAY) * x),
            "m1": jnp.where(first, m1, cfg.decay * m1 + (1 - cfg.decay) * r),
            "m2": jnp.where(first, m2, cfg.decay * m2 + (1 - cfg.decay) * r**2),
        }
        old = {"level": level, "m1": m1, "m2": m2}
        new |= {f"{q}_{k}": jnp.where(skipped, old[k], moved[k]) for k in moved}
    one = jnp.ones((), jnp.int32)
    streak = jnp.where(skipped, stats["streak"] + 1, 0)
    accepted = stats["accepted"] + jnp.where(skipped, 0, one)
    # `warmup` skips in a row: the quantity has moved to a new level rather than spiked (skipped steps never
    # move the statistics, so they would never adapt); start them again, warming up from the next step
    regime = streak >= cfg.warmup
    new = {k: jnp.where(regime, jnp.zeros_like(v), v) for k, v in new.items()}
    return new | {"accepted": jnp.where(regime, 0, accepted),
                  "skipped": stats["skipped"] + jnp.where(skipped, one, 0), "streak": streak}
