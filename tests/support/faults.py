"""Faults planted in the real jitted train call."""

import jax
import jax.numpy as jnp

from trainer.program.train_program import TrainProgram


def nan_gradient_at(monkeypatch, bad_step: int) -> None:
    """The gradients of step `bad_step` (1-based) become NaN inside the real jitted call."""
    monkeypatch.setattr(TrainProgram, "_gradient_hook", lambda self, grads, step: jax.tree.map(
        lambda g: jnp.where(step + 1 == bad_step, jnp.nan, g), grads))
