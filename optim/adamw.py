"""AdamW (Loshchilov & Hutter 2019) on every parameter: optax's, with decay on matrices and embeddings only, and
under μP (model.parametrization=mup) each hidden matrix's rate × 1/m, as the `mup` package's MuAdamW."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import jax
import jax.numpy as jnp
import optax

from fields import Field
from optim.base import OptimizerConfig, by_path, decay_mask, is_hidden_matrix


@dataclasses.dataclass(frozen=True)
class AdamWConfig(OptimizerConfig, choice="adamw"):
    """AdamW on every parameter."""

    b1: Annotated[float, Field("Adam's first-moment decay", ge=0, lt=1)] = 0.9
    b2: Annotated[float, Field(
        "Adam's second-moment decay; 0.95 as in GPT-3 (Brown et al. 2020, appendix B)", ge=0, lt=1)] = 0.95
    eps: Annotated[float, Field("Adam epsilon", gt=0)] = 1e-8
    weight_decay: Annotated[float, Field(
        "decoupled weight decay, applied to matrices and embeddings only (not biases or norms)", ge=0)] = 0.1

    def describe(self, params, width_mult: float | None = None) -> str:
        """Under μP the logged `lr` is the embeddings', norms' and biases' rate: the hidden matrices' is said here."""
        text = super().describe(params)
        if width_mult is None:
            return text
        return f"{text}, its hidden matrices at lr/m = {self.lr / width_mult:g} (μP, m = {width_mult:g})"

    def update_rule(self, rates: dict[str, optax.Schedule], width_mult: float | None = None
                    ) -> optax.GradientTransformation:
        """optax.adamw; under μP (a width_mult) Adam's direction multiplied per parameter (`mup_lr_multipliers`)
        before the decoupled weight decay is added, so a parameter's rate is lr · multiplier while its decay per step
        stays lr · weight_decay: what mup's MuAdamW does (rate / m, weight decay × m, on torch's p ← p·(1 −
        rate·decay))."""
        rate = rates["lr"]
        if width_mult is None:
            return optax.adamw(rate, b1=self.b1, b2=self.b2, eps=self.eps, weight_decay=self.weight_decay,
                               mask=decay_mask)
        return optax.chain(
            optax.scale_by_adam(b1=self.b1, b2=self.b2, eps=self.eps),
            optax.stateless(lambda updates, params: jax.tree.map(
                jnp.multiply, updates, mup_lr_multipliers(updates, width_mult))),
            optax.add_decayed_weights(self.weight_decay, decay_mask),
            optax.scale_by_learning_rate(rate),
        )


def mup_lr_multipliers(params, width_mult: float):
    """μP's multiplier of Adam's learning rate for each parameter: 1/m for the hidden matrices (both their dimensions
    grow with the width), 1 for embeddings (wte is the tied readout too), biases and norms. The `mup` package's
    MuAdamW: a matrix-like parameter's rate / width_mult, a vector-like one's unchanged."""
    return by_path(params, lambda path, v: 1.0 / width_mult if is_hidden_matrix(v) else 1.0)
