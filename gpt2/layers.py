"""GPT-2's building blocks as Flax NNX modules: LayerNorm, attention, MLP, Block.

Parameters carry *logical* axis names in their `out_sharding` metadata (see `gpt2/sharding.py` for the
one table that maps them onto the device mesh). Module and parameter names follow the GPT-2 checkpoint
(`ln_1`, `attn.c_attn`, `attn.c_proj`, `ln_2`, `mlp.c_fc`, `mlp.c_proj`), so HF import is a table.

Shape legend: B batch, T time (query), S time (key/value), D embed, H heads, K head dim, F mlp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gpt2 import cudnn
from gpt2.config import QKV, ConfigError, GPT2Config
from gpt2.sharding import ShardingRules
from gpt2.splash import splash_attention, target_platform

# (k, v) of the attention's keys and values: each [B, S, H, K] for one block; GPT2.decode keeps all blocks'
# caches stacked as [L, B, S, H, K] (the scan over layers hands each block its slice).
KVCache = tuple[jax.Array, jax.Array]


def param_meta(*logical_axes: str | None, **facts) -> dict:
    """Metadata that names a parameter's logical axes (and any other `facts` about it, e.g. `matrix`).

    `eager_sharding=False`: NNX would otherwise try to shard at birth with the *logical* names; we resolve
    them through our rules table in `create_sharded_model` instead (the documented jit + constraint pattern).
    """
    return {"out_sharding": logical_axes, "eager_sharding": False, **facts}


# Axes as (reduction axes, output axes), counted from the end: how a weight reads as a matrix.
MatrixAxes = tuple[tuple[int, ...], tuple[int, ...]]


def hidden_matrix(config: GPT2Config, std: float, matrix: MatrixAxes, *logical_axes: str) -> dict:
    """A hidden matrix's kernel_init and kernel_metadata: the one declaration of the weights whose dimensions both
    grow with the width (c_attn, both c_proj, c_fc). Three features read it: the init (GPT-2's `std`, × 1/√m under
    μP: variance ∝ 1/fan_in), μP's Adam rate × 1/m (optim/adamw.py) and Muon's orthogonalized update
    (optim/muon.py), which sees the weight as the `matrix` axes' reduction × output matrix (the others batch it)."""
    return dict(kernel_init=normal(config.hidden_init_std(std)),
                kernel_metadata=param_meta(*logical_axes, matrix=matrix))


def matrix_axes(variable: nnx.Variable) -> MatrixAxes | None:
    """A hidden matrix's (reduction, output) axes as `hidden_matrix` declared them; None for any other parameter."""
    return variable.get_metadata().get("matrix")


def normal(std: float) -> nnx.Initializer:
    return nnx.initializers.normal(stddev=std)


class LayerNorm(nnx.LayerNorm):
    """LayerNorm over D with GPT-2's epsilon; `scale` and `bias` are HF's `weight` and `bias`."""

    def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs):
        super().__init__(
            config.n_embd,
            epsilon=config.layer_norm_epsilon,
            use_bias=config.bias,
            dtype=config.compute_dtype,
            param_dtype=config.parameter_dtype,
            scale_metadata=param_meta("embed"),
            bias_metadata=param_meta("embed"),
            rngs=rngs,
        )


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention with GPT-2's fused QKV projection.

    `c_attn.kernel` is stored as [D, 3, H, K] (GPT-2's [D, 3·D] with the output split into q|k|v, heads,
    head dim) so that tensor parallelism can shard whole heads.

    Args:
      config: the architecture; `attention` picks the implementation (see `attention_implementation`).
      rngs: parameter initialization randomness.
      rules: how batch and heads are split over the mesh, for the splash kernel's `shard_map` (None: the
        kernel sees whole arrays).
    """

    def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs, rules: ShardingRules | None = None):
        D, H, K = config.n_embd, config.n_head, config.head_dim
        dtypes = dict(dtype=config.compute_dtype, param_dtype=config.parameter_dtype)
        # [D] -> [(q,k,v), H, K]: as a matrix D × H·K for each of q, k and v (the qkv axis batches them)
        self.c_attn = nnx.LinearGeneral(
            D, (3, H, K), use_bias=config.bias,
            **hidden_matrix(config, 0.02, ((-4,), (-2, -1)), "embed", "qkv", "heads", "head_dim"),
            bias_metadata=param_meta("qkv", "heads", "head_dim"), rngs=rngs, **dtypes,
        )
        # [H, K] -> [D]; a residual projection: GPT-2 scales its init by 1/sqrt(2·n_layer)
        self.c_proj = nnx.LinearGeneral(
            (H, K), D, axis=(-2, -1), use_bias=config.bias,
            **hidden_matrix(config, config.residual_init_std, ((-3, -2), (-1,)), "heads", "head_dim", "embed"),
            bias_metadata=param_meta("embed"), rngs=rngs, **dtypes,
        )
        self.resid_dropout = nnx.Dropout(config.dropout)
        self.attention, self.dtype_name = config.attention, config.dtype  # the kernel: chosen when traced
        self.scale = config.attention_scale  # of q·k: 1/√K, or μP's √K_base/K
        self.query_blocks = config.attention_query_blocks
        self.splash_blocks = (config.splash_block_q, config.splash_block_kv)  # a tuple: graph statics are hashed
        self.rules = rules

    def __call__(
        self,
        x: jax.Array,  # [B, T, D]
        *,
        segment_ids: jax.Array | None = None,  # [B, T] int: documents packed in a row see only themselves
        cache: KVCache | None = None,
        cache_index: jax.Array | None = None,  # position of x[:, 0] in the cache
        dropout_key: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        qkv = jax.ad_checkpoint.checkpoint_name(self.c_attn(x), QKV)  # [B, T, 3, H, K]; remat="dots" keeps it
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # each [B, T, H, K]
        if cache is None:
            y = self._causal_attention(q, k, v, segment_ids)
        else:  # decoding: the prompt, then one token at a time, against the cache (small: dense is fine)
            k, v = _update_cache(cache, k, v, cache_index)  # each [B, S, H, K]
            cache = (k, v)
            y = jax.nn.dot_product_attention(q, k, v, mask=_causal_mask(q, k, cache_index), scale=self.scale)
        y = self.c_proj(y)  # [B, T, D]
        y = self.resid_dropout(y, deterministic=dropout_key is None, rngs=dropout_key)
        return y, cache

    def _causal_attention(self, q, k, v, segment_ids) -> jax.Array:  # each [B, T, H, K] -> [B, T, H, K]
        implementation = attention_implementation(self.attention, self.dtype_name, q.shape[-1], q.shape[1],
                                                  masked=segment_ids is not None)
        if implementation == "splash":  # skips the masked blocks itself: query_blocks does not apply
            block_q, block_kv = self.splash_blocks
            return splash_attention(q, k, v, segment_ids, scale=self.scale, block_q=block_q, block_kv=block_kv,
                                    rules=self.rules)
        packed = segment_ids is not None and cudnn.packs_documents(cudnn.device_capability())
        if implementation == "cudnn" and packed:
            return cudnn.packed_attention(q, k, v, segment_ids, scale=self.scale)  # no [T, T] mask anywhere
        T, n = q.shape[1], self.query_blocks
        if n == 1 or T % n or segment_ids is not None:
            # The causal flag, not a materialized [T, T] mask, lets XLA/cuDNN kernels skip the work.
            mask = None if segment_ids is None else _same_segment(segment_ids)
            return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, scale=self.scale,
                                                implementation=implementation)
        size, outs = T // n, []
        for i in range(n):  # query block i sees keys [0, (i + 1)·size): the blocks right of it are all masked
            start, end = i * size, (i + 1) * size
            q_block, k_prefix = q[:, start:end], k[:, :end]
            outs.append(jax.nn.dot_product_attention(q_block, k_prefix, v[:, :end], implementation=implementation,
                                                     mask=_causal_mask(q_block, k_prefix, start), scale=self.scale))
        return jnp.concatenate(outs, axis=1)


def attention_implementation(choice: str, dtype: str, head_dim: int, seq_len: int, masked: bool = False) -> str:
    """What `model.attention` means for the program being traced: "splash", "cudnn" or "xla". "auto" is the fast
    kernel of the target: splash on a TPU; cuDNN's flash attention on a GPU where it can run this attention
    (gpt2/cudnn.py `refusal`: half precision, the head dimension, the GPU), with packed documents as segment
    offsets from Hopper on; XLA's otherwise (jax.nn.dot_product_attention's own default is XLA's everywhere).

    "auto" is resolved here, when the attention is traced, and not in GPT2Config or at construction: the model's
    structure is built before any mesh exists (Evaluator.build), and only the trace knows its target — the mesh
    in context (`jax.set_mesh`), which is a TPU topology's when planning/aot.py compiles for TPUs on a CPU host.
    """
    if choice != "auto":
        return choice
    platform = target_platform()
    if platform == "tpu":
        return "splash"
    if platform == "gpu" and cudnn.refusal(dtype, head_dim, seq_len, cudnn.device_capability(), masked) is None:
        return "cudnn"
    return "xla"


def check_attention(config: GPT2Config, seq_len: int) -> None:
    """Refuses model.attention=cudnn, before any work, where cuDNN's flash attention cannot run it (JAX would fail
    inside the first call's compile)."""
    if config.attention != "cudnn":
        return
    if target_platform() != "gpu":
        raise ConfigError(f"--model.attention=cudnn needs an NVIDIA GPU, not {target_platform()}; use auto")
    why = cudnn.refusal(config.dtype, config.head_dim, seq_len, cudnn.device_capability(), config.document_mask)
    if why:
        raise ConfigError(f"--model.attention=cudnn: {why}; or --model.attention=auto (XLA's then)")


def describe_attention(config: GPT2Config, seq_len: int) -> str:
    """The start-up's word on the attention kernel (under the run's mesh), and why not cuDNN's on a GPU where
    "auto" falls back to XLA's."""
    masked = config.document_mask
    chosen = attention_implementation(config.attention, config.dtype, config.head_dim, seq_len, masked)
    if chosen == "cudnn":
        packed = config.document_mask and cudnn.packs_documents(cudnn.device_capability())
        return "cudnn flash" + ("; documents as packed segments" if packed else
                                "; documents as a [B, 1, T, T] mask" if config.document_mask else "")
    why = cudnn.refusal(config.dtype, config.head_dim, seq_len, cudnn.device_capability(), masked)
    if chosen == "xla" and config.attention == "auto" and target_platform() == "gpu" and why:
        return f"xla ({why})"
    return chosen


def _update_cache(cache: KVCache, k: jax.Array, v: jax.Array, index: jax.Array) -> KVCache:
    k_cache, v_cache = cache
    start = (0, index, 0, 0)
    k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), start)
    v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), start)
    return k_cache, v_cache


def _same_segment(segment_ids: jax.Array) -> jax.Array:  # [B, T] -> [B, 1, T, T]
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def _causal_mask(q: jax.Array, k: jax.Array, index) -> jax.Array:
    """[1, 1, T, S] mask: query t (at position index + t) sees key positions s <= index + t."""
    q_pos = index + jnp.arange(q.shape[1])[:, None]  # [T, 1]
    k_pos = jnp.arange(k.shape[1])[None, :]  # [1, S]
    return (k_pos <= q_pos)[None, None]


class MLP(nnx.Module):
    """Position-wise feed-forward: c_fc (D -> F), tanh-approximated GELU as in GPT-2, c_proj (F -> D)."""

    def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs):
        D, F = config.n_embd, 4 * config.n_embd
        dtypes = dict(dtype=config.compute_dtype, param_dtype=config.parameter_dtype)
        self.c_fc = nnx.Linear(
            D, F, use_bias=config.bias, **hidden_matrix(config, 0.02, ((-2,), (-1,)), "embed", "mlp"),
            bias_metadata=param_meta("mlp"), rngs=rngs, **dtypes,
        )
        self.c_proj = nnx.Linear(  # a residual projection, as attn.c_proj
            F, D, use_bias=config.bias,
            **hidden_matrix(config, config.residual_init_std, ((-2,), (-1,)), "mlp", "embed"),
            bias_metadata=param_meta("embed"), rngs=rngs, **dtypes,
        )
        self.dropout = nnx.Dropout(config.dropout)

    def __call__(self, x: jax.Array, *, dropout_key: jax.Array | None = None) -> jax.Array:
        h = jax.nn.gelu(self.c_fc(x), approximate=True)  # [B, T, F]
        y = self.c_proj(h)  # [B, T, D]
        return self.dropout(y, deterministic=dropout_key is None, rngs=dropout_key)


class Block(nnx.Module):
    """Pre-LayerNorm transformer block (GPT-2, Radford et al. 2019, section 2.3); under μP with depth scaling each
    residual branch is multiplied by L_base/L (CompleteP, Dey et al. 2025)."""

    def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs, rules: ShardingRules | None = None):
        self.ln_1 = LayerNorm(config, rngs=rngs)
        self.attn = CausalSelfAttention(config, rngs=rngs, rules=rules)
        self.ln_2 = LayerNorm(config, rngs=rngs)
        self.mlp = MLP(config, rngs=rngs)
        self.branch_scale = config.residual_multiplier  # 1 unless μP scales with depth

    def __call__(
        self,
        x: jax.Array,  # [B, T, D]
        *,
        segment_ids: jax.Array | None = None,  # [B, T]
        cache: KVCache | None = None,
        cache_index: jax.Array | None = None,
        dropout_key: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        k_attn, k_mlp = jax.random.split(dropout_key) if dropout_key is not None else (None, None)
        with jax.named_scope("attn"):
            a, cache = self.attn(self.ln_1(x), segment_ids=segment_ids, cache=cache, cache_index=cache_index,
                                 dropout_key=k_attn)
        x = x + self.branch_scale * a
        with jax.named_scope("mlp"):
            x = x + self.branch_scale * self.mlp(self.ln_2(x), dropout_key=k_mlp)
        return x, cache
