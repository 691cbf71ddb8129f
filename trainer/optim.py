"""The optimizer: Optax AdamW, warmup + cosine schedule, global-norm clipping, decay on matrices only."""

from __future__ import annotations

import jax
import optax
from flax import nnx

from configs.base import OptimConfig


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to `lr`, then cosine decay to `lr · min_lr_ratio` (nanoGPT's schedule)."""
    decay_steps = max(cfg.decay_steps or total_steps, cfg.warmup_steps + 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
        decay_steps=decay_steps, end_value=cfg.lr * cfg.min_lr_ratio,
    )


def decay_mask(params: nnx.State) -> nnx.State:
    """True for matmul weights and embeddings (GPT-2's 2-D weights); biases and norm scales are not decayed.

    Decided by name, not `ndim`: with scan_layers a LayerNorm scale is [L, D], and the fused QKV bias is
    stored as [3, H, K], yet both are vectors in GPT-2's terms.
    """

    def decays(path, v: nnx.Variable) -> nnx.Variable:
        return v.replace(path[-1].key in ("kernel", "embedding"))

    return jax.tree_util.tree_map_with_path(decays, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity(),
        optax.adamw(
            lr_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
            weight_decay=cfg.weight_decay, mask=decay_mask,
        ),
    )
