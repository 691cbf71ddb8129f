"""The spike guard, an optax transformation: it wraps the optimizer and skips a step whose loss or gradient norm is
an outlier, keeping the running statistics that decide it in the optimizer state (so a checkpoint carries them and
a resume stays exact). Levanter's `optim/skipstep.py` is the same idea.

A step is judged on numbers it computes anyway (its loss, passed in as `update(..., loss=loss)`, and the gradient
norm before clipping). The loss falls throughout training, fast at first, so a z-score against a plain moving mean
mistakes the trend for spread (early on, a loss at the initial level scored under 2σ). Each quantity is therefore
judged by its residual against a fast-moving level (the trend), standardized by the moving mean and variance of
past residuals: a steady trend only shifts the residuals' mean. A skipped step gives zero updates, keeps the
wrapped optimizer's state (its count, and so its learning-rate schedule, moves with applied steps only) and moves
none of the statistics, so one spike cannot raise the bar for the next. See configs.base.GuardConfig for the
thresholds.

The transformation is always in the chain, so the train state has one structure whether the guard is on or off
(and a run may switch it at a resume); with `guard.skip_spikes` off it only passes the update through.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from configs.base import GuardConfig

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


def without_streak(state: SpikeGuardState) -> SpikeGuardState:
    """After a rollback the new data gets a fresh count (the checkpoint may have been saved mid-streak)."""
    return state._replace(stats=state.stats | {"streak": jnp.zeros_like(state.stats["streak"])})


def init_stats() -> GuardStats:
    stats = {f"{q}_{k}": jnp.zeros((), jnp.float32) for q in QUANTITIES for k in ("level", "m1", "m2")}
    return stats | {k: jnp.zeros((), jnp.int32) for k in ("accepted", "skipped", "streak")}  # own buffers: donated


def all_finite(tree) -> jax.Array:
    """bool[]: every element of every floating leaf is finite (one fused reduction on the devices)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves]))


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
