"""Splash attention — the TPU Pallas kernel of `jax.experimental.pallas.ops.tpu.splash_attention` — on the model's
[B, T, H, K] activations: causal, with optional document (segment) masking, sharded over the mesh in context.

The kernel ("sparse flash") works on one example's [H, T, K], never materializes the [T, T] scores, and skips
every block its mask hides entirely, so causal attention does about half of dense attention's work. It only
runs compiled on TPU; elsewhere it runs in Pallas's interpret mode (slow, for tests on CPU).
Kernel source: jax/experimental/pallas/ops/tpu/splash_attention/splash_attention_kernel.py (jax 0.10.2).

Shape legend as in layers.py: B batch, T time, H heads, K head dim; lower-case b, h: one device's share.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
from jax.sharding import NamedSharding, PartitionSpec

from gpt2.config import QKV
from gpt2.sharding import MeshAxes, ShardingRules

# The kernel tiles the sequence by the TPU's 128 lanes: every block size must be a multiple of it
# (NUM_LANES in splash_attention_kernel.py; checked there for block_kv_compute and the segment-id tiles).
LANES = 128


def target_platform() -> str:
    """The platform of the program being traced: the mesh in context's (`jax.set_mesh`), which is a TPU
    topology's when planning/aot.py compiles for TPUs from a CPU host; without a mesh, the default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    return device.platform if device is not None else jax.default_backend()


def splash_attention(
    q: jax.Array,  # [B, T, H, K]
    k: jax.Array,  # [B, T, H, K]
    v: jax.Array,  # [B, T, H, K]
    segment_ids: jax.Array | None,  # [B, T] int: a query sees only keys of its own segment; None: one segment
    *,
    scale: float | None = None,  # the softmax scale of q·k; None: 1/√K (GPT-2's)
    block_q: int,
    block_kv: int,
    rules: ShardingRules | None,
) -> jax.Array:  # [B, T, H, K]
    """Causal attention through the splash kernel, in a `jax.shard_map` over the mesh in context.

    Batch and heads are split as `rules` split the activations' batch and the heads (each device runs the
    kernel on its own examples and heads; no communication); the sequence stays whole, since the kernel
    cannot split keys (`manual_sharding_spec` refuses a sharded kv dimension). Under a mesh the shard_map is
    not optional: "Mosaic kernels cannot be automatically partitioned" (jax/_src/tpu_custom_call.py). Without
    rules every device computes the whole attention (correct, redundant); outside a mesh the kernel sees the
    whole arrays.
    """
    B, T, H, K = q.shape
    if segment_ids is None:
        segment_ids = jnp.zeros((B, T), jnp.int32)
    pad = -T % LANES
    if pad:  # causal: the padded keys come after every real query, so none is ever attended to
        q, k, v = (jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0))) for a in (q, k, v))
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)), mode="edge")
    q = q * (1 / math.sqrt(K) if scale is None else scale)  # the kernel applies no softmax scale
    make = functools.partial(_kernel, T + pad, H, _fit(block_q, T + pad), _fit(block_kv, T + pad),
                             interpret=target_platform() != "tpu")
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return _attend(make(head_shards=1), q, k, v, segment_ids)[:, :T]
    batch, _, heads, _ = (None,) * 4 if rules is None else rules.spec(("batch", None, "heads", None))
    batch, heads = _if_divides(batch, B, mesh), _if_divides(heads, H, mesh)
    kernel = make(head_shards=_parts(heads, mesh))
    # the kernel's mask tables are split over the heads like q, k and v (one entry per head shard)
    kernel_spec = kernel.manual_sharding_spec(NamedSharding(mesh, PartitionSpec(heads, None)))
    qkv_spec = PartitionSpec(batch, None, heads, None)  # [B, T, H, K]
    sharded = jax.shard_map(
        _attend, in_specs=(kernel_spec, qkv_spec, qkv_spec, qkv_spec, PartitionSpec(batch, None)),
        out_specs=qkv_spec,
        # the kernel's pallas_call declares its outputs without the mesh axes they vary over ("manual_axis_type
        # on jax.ShapeDtypeStruct must not be None" otherwise)
        check_vma=False,
    )
    return sharded(kernel, q, k, v, segment_ids)[:, :T]


def _attend(kernel, q, k, v, segment_ids):  # [b, T, h, K] ×3, [b, T] -> [b, T, h, K]
    """The kernel on one device's examples: it takes one example's [h, T, K], so vmap over b."""
    heads_first = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731  [b, T, h, K] <-> [b, h, T, K]
    ids = sk.SegmentIds(q=segment_ids, kv=segment_ids)
    q, k, v = (jax.ad_checkpoint.checkpoint_name(heads_first(a), QKV) for a in (q, k, v))  # remat="dots" keeps them
    return heads_first(jax.vmap(kernel)(q, k, v, ids))


def _kernel(T: int, H: int, block_q: int, block_kv: int, *, head_shards: int, interpret: bool):
    """The kernel for [H / head_shards, T, K] per device. Its block tables are computed in numpy and cached by the
    kernel's library (`_process_mask` in splash_attention_mask_info.py), so every trace may build it afresh.
    Every backward block size is set: without them the kernel has no gradient ("Need to specify backward
    blocks")."""
    sizes = sk.BlockSizes(
        block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv,
        block_q_dkv=block_q, block_kv_dkv=block_kv, block_kv_dkv_compute=block_kv,
        block_q_dq=block_q, block_kv_dq=block_kv,
    )
    mask = sm.MultiHeadMask([sm.CausalMask((T, T))] * H)
    return sk.make_splash_mha(mask, block_sizes=sizes, head_shards=head_shards, q_seq_shards=1, interpret=interpret)


def _fit(block: int, T: int) -> int:
    """The largest multiple of LANES that is at most `block` and divides T (itself a multiple of LANES): the
    kernel needs whole blocks ("q_block_size should divide q_seq_len", splash_attention_mask_info.py)."""
    block = min(block, T)
    while T % block:
        block -= LANES
    return block


def _parts(axes: MeshAxes, mesh) -> int:
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return int(np.prod([mesh.shape[a] for a in names]))


def _if_divides(axes: MeshAxes, size: int, mesh) -> MeshAxes:
    """`axes` if they split `size` evenly (shard_map needs whole shards), else None: replicated, e.g. for a
    single sequence sampled on a data-parallel mesh."""
    return axes if size % _parts(axes, mesh) == 0 else None
