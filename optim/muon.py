"""Muon (Jordan et al. 2024, modded-nanogpt; optax.contrib's Newton–Schulz orthogonalized momentum) on the hidden
matrices, AdamW (the fields it inherits) on the embeddings and tied head, norms and biases."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import optax
from flax import nnx

from fields import Field
from gpt2.layers import matrix_axes
from optim.adamw import AdamWConfig
from optim.base import by_path, is_hidden_matrix, parameters_per_group


@dataclasses.dataclass(frozen=True)
class MuonConfig(AdamWConfig, choice="muon"):
    """Muon on the attention and MLP matrices of every layer; AdamW (lr, b1, b2, eps, weight_decay) on the rest."""

    muon_lr: Annotated[float, Field("the Muon group's peak rate, on the same schedule as lr", gt=0)] = 0.02
    muon_momentum: Annotated[float, Field("Muon's Nesterov momentum (modded-nanogpt: 0.95)", ge=0, lt=1)] = 0.95
    muon_weight_decay: Annotated[float, Field(
        "decoupled weight decay of the Muon group, multiplied by its rate as in optax", ge=0)] = 0.0
    muon_ns_steps: Annotated[int, Field("Newton–Schulz iterations (modded-nanogpt: 5)", ge=1)] = 5
    muon_ns_coeffs: Annotated[tuple[float, float, float], Field(
        "the Newton–Schulz quintic's (a, b, c) (modded-nanogpt's by default)")] = (3.4445, -4.7750, 2.0315)

    def update_rule(self, rates: dict[str, optax.Schedule], width_mult: float | None = None
                    ) -> optax.GradientTransformation:
        # μP's 1/m is for Adam on the hidden matrices, which are Muon's here: Muon's own max(1, fan_out/fan_in)^½
        # (optax's scale_by_shape) sizes their updates, and every parameter AdamW keeps has multiplier 1
        muon = optax.contrib.muon(
            rates["lr/muon"], ns_coeffs=self.muon_ns_coeffs, ns_steps=self.muon_ns_steps,
            beta=self.muon_momentum, weight_decay=self.muon_weight_decay, nesterov=True,
            muon_weight_dimension_numbers=lambda params: by_path(params, lambda path, v: muon_dimensions(v)))
        adamw = AdamWConfig.update_rule(self, rates)
        return optax.partition({"lr/muon": muon, "lr": adamw},
                               lambda params: by_path(params, lambda path, v: self.group_of(path, v)))

    def peak_rates(self) -> dict[str, float]:
        return {"lr/muon": self.muon_lr, "lr": self.lr}

    def group_of(self, path: tuple[str, ...], variable: nnx.Variable) -> str:
        return "lr/muon" if is_hidden_matrix(variable) else "lr"

    def describe(self, params: nnx.State, width_mult: float | None = None) -> str:
        counts = parameters_per_group(self, params)
        return (f"muon (lr {self.muon_lr:g}) on {counts.get('lr/muon', 0):,} parameters (attention and MLP"
                f" matrices), adamw (lr {self.lr:g}) on {counts.get('lr', 0):,} (embeddings and tied head, norms,"
                " biases)")


def muon_dimensions(variable: nnx.Variable) -> optax.contrib.MuonDimensionNumbers | None:
    """How a hidden matrix's axes read as a matrix for Muon (gpt2/layers.py declares them); None for the parameters
    AdamW keeps. Counted from the end, so a scanned [L, ...] weight is the same matrix with its layer axis as a
    batch axis: one orthogonalization per layer."""
    axes = matrix_axes(variable)
    return None if axes is None else optax.contrib.MuonDimensionNumbers(*axes)
