"""The optimizer: global-norm clipping, then AdamW (decay on matrices and embeddings only) on every parameter,
or Muon on the hidden matrices and AdamW on the rest; warmup + cosine schedules. Under μP
(model.parametrization=mup) AdamW's rate has a multiplier per parameter (`mup_lr_multipliers`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from configs.base import OptimConfig
from gpt2.config import GPT2Config

# Muon's matrices, by parameter path, and how each one's axes read as a matrix (counted from the end, so a
# scanned [L, ...] weight is the same matrix with its layer axis as a batch axis: one orthogonalization per
# layer). c_attn is [D, 3, H, K]: q, k and v are three [D, H·K] matrices (the qkv axis is a batch axis too).
MUON_MATRICES = {
    ("attn", "c_attn", "kernel"): optax.contrib.MuonDimensionNumbers(reduction_axis=-4, output_axis=(-2, -1)),
    ("attn", "c_proj", "kernel"): optax.contrib.MuonDimensionNumbers(reduction_axis=(-3, -2), output_axis=-1),
    ("mlp", "c_fc", "kernel"): optax.contrib.MuonDimensionNumbers(reduction_axis=-2, output_axis=-1),
    ("mlp", "c_proj", "kernel"): optax.contrib.MuonDimensionNumbers(reduction_axis=-2, output_axis=-1),
}


def lr_schedule(cfg: OptimConfig, total_steps: int, peak: float | None = None) -> optax.Schedule:
    """Linear warmup from 0 to `peak` (default `lr`), then cosine decay to `peak · min_lr_ratio` (nanoGPT's
    schedule)."""
    peak = cfg.lr if peak is None else peak
    decay_steps = max(cfg.decay_steps or total_steps, cfg.warmup_steps + 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak, warmup_steps=cfg.warmup_steps,
        decay_steps=decay_steps, end_value=peak * cfg.min_lr_ratio,
    )


def _by_path(params: nnx.State, leaf) -> nnx.State:
    """A tree like `params` with `leaf(path of names, variable)` in each variable."""

    def at(path, v: nnx.Variable) -> nnx.Variable:
        return v.replace(leaf(tuple(getattr(p, "key", p) for p in path), v))

    return jax.tree_util.tree_map_with_path(at, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def decay_mask(params: nnx.State) -> nnx.State:
    """True for matmul weights and embeddings (GPT-2's 2-D weights); biases and norm scales are not decayed.

    Decided by name, not `ndim`: with scan_layers a LayerNorm scale is [L, D], and the fused QKV bias is
    stored as [3, H, K], yet both are vectors in GPT-2's terms.
    """
    return _by_path(params, lambda path, v: path[-1] in ("kernel", "embedding"))


def muon_dimensions(path: tuple) -> optax.contrib.MuonDimensionNumbers | None:
    """How the parameter at `path` reads as a matrix for Muon; None for the parameters AdamW keeps."""
    return MUON_MATRICES.get(tuple(path[-3:]))


def optimizer_of(params: nnx.State) -> nnx.State:
    """"muon" or "adamw" for each parameter (with optim.name=muon)."""
    return _by_path(params, lambda path, v: "muon" if muon_dimensions(path) else "adamw")


def mup_lr_multipliers(model: GPT2Config, params: nnx.State) -> nnx.State:
    """μP's multiplier of Adam's learning rate for each parameter: 1/m for the hidden matrices (the four kernels
    Muon would own: both their dimensions grow with the width), 1 for embeddings (wte is the tied readout too),
    biases and norms; m = model.width_mult (so all 1 under the standard parametrization). The `mup` package's
    MuAdamW: a matrix-like parameter's rate / width_mult, a vector-like one's unchanged."""
    m = model.width_mult
    return _by_path(params, lambda path, v: 1.0 / m if muon_dimensions(path) else 1.0)


def scale_per_parameter(multipliers) -> optax.GradientTransformation:
    """Multiplies each update by its parameter's entry in `multipliers(updates)` (a tree like the updates)."""
    return optax.stateless(lambda updates, params: jax.tree.map(jnp.multiply, updates, multipliers(updates)))


def adamw(cfg: OptimConfig, total_steps: int, model: GPT2Config | None = None) -> optax.GradientTransformation:
    """optax.adamw; under μP with Adam's direction multiplied per parameter (`mup_lr_multipliers`) before the
    decoupled weight decay is added, so a parameter's rate is lr · multiplier while its decay per step stays
    lr · weight_decay: what mup's MuAdamW does (rate / m, weight decay × m, on torch's p ← p·(1 − rate·decay))."""
    schedule = lr_schedule(cfg, total_steps)
    if model is None or model.parametrization == "standard":
        return optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                           mask=decay_mask)
    return optax.chain(
        optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps),
        scale_per_parameter(lambda updates: mup_lr_multipliers(model, updates)),
        optax.add_decayed_weights(cfg.weight_decay, decay_mask),
        optax.scale_by_learning_rate(schedule),
    )


def muon(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """optax's Muon, given only the hidden matrices (its own AdamW fallback then holds nothing)."""
    return optax.contrib.muon(
        lr_schedule(cfg, total_steps, peak=cfg.muon_lr), ns_coeffs=cfg.muon_ns_coeffs, ns_steps=cfg.muon_ns_steps,
        beta=cfg.muon_momentum, weight_decay=cfg.muon_weight_decay, nesterov=True,
        muon_weight_dimension_numbers=lambda params: _by_path(params, lambda path, v: muon_dimensions(path)),
    )


def make_optimizer(cfg: OptimConfig, total_steps: int, model: GPT2Config | None = None
                   ) -> optax.GradientTransformation:
    """The optimizer of a run; `model` (None: the standard parametrization) for μP's rate multipliers."""
    if cfg.name == "muon":
        # μP's 1/m is for Adam on the hidden matrices, which are Muon's here: Muon's own max(1, fan_out/fan_in)^½
        # (optax's scale_by_shape) sizes their updates, and every parameter AdamW keeps has multiplier 1
        update = optax.partition({"muon": muon(cfg, total_steps), "adamw": adamw(cfg, total_steps)}, optimizer_of)
    else:
        update = adamw(cfg, total_steps, model)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity(), update)


def parameters_per_optimizer(cfg: OptimConfig, params: nnx.State) -> dict[str, int]:
    """How many parameters each optimizer updates (for the start-up summary)."""
    if cfg.name != "muon":
        return {"adamw": sum(x.size for x in jax.tree.leaves(params))}
    labels = jax.tree.leaves(optimizer_of(params))
    counts = {"muon": 0, "adamw": 0}
    for label, x in zip(labels, jax.tree.leaves(params)):
        counts[label] += x.size
    return counts
