"""The spike guard: inside the scanned train call, skip an optimizer step whose loss or gradient norm is an
outlier, and keep the running statistics that decide it in the train state (so a resume stays exact).

A step is judged on numbers it computes anyway (its loss, and the gradient norm before clipping). The loss
falls throughout training, fast at first, so a z-score against a plain moving mean mistakes the trend for
spread (early on, a loss at the initial level scored under 2σ). Each quantity is therefore judged by its
residual against a fast-moving level (the trend), standardized by the moving mean and variance of past
residuals: a steady trend only shifts the residuals' mean. A skipped step moves none of the statistics, so
one spike cannot raise the bar for the next. See configs.base.GuardConfig for the thresholds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from configs.base import GuardConfig

LEVEL_DECAY = 0.9  # the level follows the trend within ~10 accepted steps

# per quantity q in (loss, grad): "q_level" (moving level), "q_m1", "q_m2" (moving averages of the residual
# and its square), f32[]; "accepted", "skipped": i32[] step counts; "streak": i32[] skipped steps in a row
GuardStats = dict
QUANTITIES = ("loss", "grad")


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


def without_streak(stats: GuardStats) -> GuardStats:
    """After a rollback the new data gets a fresh count (the checkpoint may have been saved mid-streak)."""
    return stats | {"streak": jnp.zeros_like(stats["streak"])}
