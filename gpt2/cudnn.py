"""cuDNN's fused (flash) attention on NVIDIA GPUs: when a program can use it, and packed documents given to it as
segment offsets instead of a dense mask.

`jax.nn.dot_product_attention(implementation="cudnn")` takes a document mask as a [B, 1, T, T] additive bias: T²
reads per layer, forward and backward. cuDNN also takes packed sequences as they are: per row, where each segment
starts and how long it is (its THD "ragged" layout: JAX's `q_offsets` / `kv_offsets` beside `q_seqlen` /
`kv_seqlen`, with a PADDING_CAUSAL mask), so each token attends causally within its own document and no T × T array
exists. JAX exposes that form only through its private cuDNN entry (jax/_src/cudnn/fused_attention_stablehlo.py),
which requires a Hopper GPU (compute capability 9.0) for packed segments.

What the GPU does is checked where one is present (`python -m benchmarks.gpu_check`: forward and gradients against
XLA's attention on rows holding several documents); tests/unit/test_attention.py checks, on a CPU, the selection
and that the offsets describe exactly the documents the segment ids do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DTYPES = ("bfloat16", "float16")  # cuDNN's fused attention computes in these (and fp8), not float32


def refusal(dtype: str, head_dim: int, seq_len: int, capability: tuple[int, int], masked: bool = False
            ) -> str | None:
    """Why cuDNN's flash attention cannot run this attention (None: it can), after JAX's own checks
    (`check_layout`, `check_is_flash_attention`): a half-precision compute dtype, a head dimension that is a
    multiple of 8 up to 128 (256 from Hopper on), an Ampere or newer GPU, and an even sequence length for its
    backward with a bias (documents `masked` before Hopper: a dense mask, which cuDNN takes as a bias)."""
    if capability < (8, 0):
        major, minor = capability
        return f"cuDNN's flash attention needs an Ampere or newer GPU (compute capability {major}.{minor})"
    if dtype not in DTYPES:
        return f"cuDNN's flash attention computes in bfloat16 or float16, not {dtype} (--model.dtype=bfloat16)"
    largest = 256 if capability >= (9, 0) else 128
    if head_dim % 8 or head_dim > largest:
        return f"cuDNN's flash attention needs a head dimension that is a multiple of 8 up to {largest}, not {head_dim}"
    if seq_len % 2 and masked and not packs_documents(capability):
        return f"cuDNN's flash attention with a document mask needs an even sequence length, not {seq_len}"
    return None


def packs_documents(capability: tuple[int, int]) -> bool:
    """Whether cuDNN takes documents as packed segments here: Hopper or newer (JAX refuses packed layouts before)."""
    return capability >= (9, 0)


def device_capability() -> tuple[int, int]:
    """The compute capability of this process's first GPU, as (major, minor); (0, 0) for any other device."""
    device = jax.devices()[0]
    text = getattr(device, "compute_capability", None) if device.platform == "gpu" else None
    return tuple(int(x) for x in text.split(".")[:2]) if text else (0, 0)


def segment_offsets(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:  # [B, T] -> [B, M], [B, M + 1]
    """The segments of packed rows as cuDNN's ragged layout takes them: (lengths, offsets), -1 where a segment id has
    no tokens. A row's segment ids rise by one at each boundary from its first token's id (gpt2/model.py
    `documents`), so id s of a row of T tokens is < T + 1 = M: segment s starts at the tokens of the ids before it
    and is as long as its own count. JAX's entry compacts the -1 entries away (`_fix_seqlen_offsets`)."""
    B, T = segment_ids.shape
    counts = jax.vmap(lambda s: jnp.bincount(s, length=T + 1))(segment_ids).astype(jnp.int32)  # [B, M]
    starts = jnp.cumsum(counts, axis=1, dtype=jnp.int32) - counts
    present = counts > 0
    lengths = jnp.where(present, counts, -1)
    offsets = jnp.pad(jnp.where(present, starts, -1), ((0, 0), (0, 1)), constant_values=-1)
    return lengths, offsets


def packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, scale: float
                     ) -> jax.Array:  # each [B, T, H, K], segment ids [B, T] -> [B, T, H, K]
    """Causal attention within each packed document, by cuDNN's ragged (THD) layout: no [T, T] mask."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    lengths, offsets = segment_offsets(segment_ids)
    return dot_product_attention(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets,
                                  kv_offsets=offsets, scale=scale, mask_type=MaskType.PADDING_CAUSAL)
