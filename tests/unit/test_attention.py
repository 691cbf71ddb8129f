"""The attention kernel `model.attention=auto` picks for the platform it is traced for, and cuDNN's packed
documents, checked on a CPU: the choice and its start-up line; the segment offsets describe exactly the documents
the segment ids do (through JAX's own compaction of them); the model's gradient lowers for CUDA to cuDNN's fused
attention with no [T, T] mask. That the GPU computes what XLA does: `python -m benchmarks.gpu_check` (on a GPU)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from errors import ConfigError
from gpt2 import GPT2, GPT2Config, cudnn, layers
from gpt2.model import EOT, documents, next_token_loss

HOPPER, AMPERE, CPU = (9, 0), (8, 0), (0, 0)


@pytest.fixture
def on(monkeypatch):
    """Traces as if for `platform`, with a GPU of compute capability `capability`."""

    def target(platform: str, capability=CPU):
        monkeypatch.setattr(layers, "target_platform", lambda: platform)
        monkeypatch.setattr(cudnn, "device_capability", lambda: capability)

    return target


@pytest.mark.parametrize("platform, capability, dtype, head_dim, chosen", [
    ("tpu", CPU, "bfloat16", 64, "splash"),
    ("gpu", HOPPER, "bfloat16", 64, "cudnn"),
    ("gpu", AMPERE, "float16", 128, "cudnn"),
    ("gpu", HOPPER, "float32", 64, "xla"),  # cuDNN's flash attention has no float32
    ("gpu", AMPERE, "bfloat16", 160, "xla"),  # past 128 before Hopper
    ("gpu", HOPPER, "bfloat16", 160, "cudnn"),
    ("gpu", (7, 5), "bfloat16", 64, "xla"),  # Turing
    ("cpu", CPU, "bfloat16", 64, "xla"),
])
def test_auto_is_the_fast_kernel_the_target_allows(on, platform, capability, dtype, head_dim, chosen):
    on(platform, capability)
    assert layers.attention_implementation("auto", dtype, head_dim, 1024) == chosen
    assert layers.attention_implementation("xla", dtype, head_dim, 1024) == "xla"  # a choice stays a choice


def test_the_start_up_says_which_kernel_and_why_not_cudnn(on):
    model = GPT2Config.gpt2(dtype="bfloat16", document_mask=True)
    on("gpu", HOPPER)
    assert layers.describe_attention(model, 1024) == "cudnn flash; documents as packed segments"
    on("gpu", AMPERE)
    assert layers.describe_attention(model, 1024) == "cudnn flash; documents as a [B, 1, T, T] mask"
    on("gpu", HOPPER)
    assert layers.describe_attention(dataclasses.replace(model, dtype="float32"), 1024) == (
        "xla (cuDNN's flash attention computes in bfloat16 or float16, not float32 (--model.dtype=bfloat16))")
    on("tpu")
    assert layers.describe_attention(model, 1024) == "splash"


def test_an_explicit_cudnn_that_cannot_run_is_refused_before_any_work(on):
    on("cpu")
    with pytest.raises(ConfigError, match="--model.attention=cudnn needs an NVIDIA GPU, not cpu"):
        layers.check_attention(GPT2Config.gpt2(attention="cudnn"), 1024)
    on("gpu", HOPPER)
    with pytest.raises(ConfigError, match="computes in bfloat16 or float16, not float32"):
        layers.check_attention(GPT2Config.gpt2(attention="cudnn"), 1024)
    layers.check_attention(GPT2Config.gpt2(attention="cudnn", dtype="bfloat16"), 1024)


def packed_rows(B: int, T: int, seed: int) -> np.ndarray:
    """[B, T] ids with documents of varied lengths: a row starting with <|endoftext|>, two in a row, none."""
    ids = np.random.default_rng(seed).integers(0, 1000, (B, T))
    ids[np.random.default_rng(seed + 1).random((B, T)) < 0.15] = EOT
    ids[0, 0] = ids[1, 5] = ids[1, 6] = EOT
    ids[2] = 7  # one document
    return ids


def test_segment_offsets_describe_each_rows_documents_after_jaxs_compaction():
    """cuDNN's PADDING_CAUSAL over (offsets, lengths), read back as a [B·T, B·T] mask after JAX hands them over
    (`_fix_seqlen_offsets`, one head of dim 1: offsets in tokens), is the model's own mask: the same document and
    not the future, row by row."""
    from jax._src.cudnn.fused_attention_stablehlo import _fix_seqlen_offsets

    B, T = 4, 32
    ids = packed_rows(B, T, 0)
    segment_ids, _ = documents(jnp.asarray(ids))
    lengths, offsets = cudnn.segment_offsets(segment_ids)
    assert lengths.shape == (B, T + 1) and offsets.shape == (B, T + 2)
    one = jnp.zeros((B, T, 1, 1))
    lengths, _, offsets, _ = map(np.asarray, _fix_seqlen_offsets(lengths, lengths, offsets, offsets, one, one))
    attends = np.zeros((B * T, B * T), bool)  # what cuDNN's ragged causal attention lets each token see
    for start, length in zip(offsets.reshape(-1), lengths.reshape(-1)):
        if length > 0:
            span = np.arange(start, start + length)
            attends[np.ix_(span, span)] = np.tril(np.ones((length, length), bool))
    seg = np.asarray(segment_ids)
    expected = np.zeros_like(attends)
    for b in range(B):
        rows = slice(b * T, (b + 1) * T)
        expected[rows, rows] = (seg[b][:, None] == seg[b][None, :]) & np.tri(T, dtype=bool)
    np.testing.assert_array_equal(attends, expected)
    assert lengths.sum() == B * T  # every token in exactly one segment


def test_the_models_gradient_lowers_for_cuda_to_cudnn_with_no_dense_mask(on, monkeypatch):
    """auto on a Hopper GPU, bfloat16, documents masked: the forward and backward of the loss lower (for CUDA, from
    this CPU, JAX's cuDNN version checks answered as a GPU would) to cuDNN's fused attention, and no [T, T] array
    of the mask is made."""
    from jax._src.cudnn import fused_attention_stablehlo as fused

    monkeypatch.setattr(fused, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(fused, "check_compute_capability", lambda capability: True)
    on("gpu", HOPPER)
    config = GPT2Config.nano(block_size=48, dtype="bfloat16", document_mask=True, scan_layers=False)  # T ≠ D
    graphdef, params = nnx.split(GPT2(config, rngs=nnx.Rngs(0)))
    loss = lambda p, batch: next_token_loss(nnx.merge(graphdef, p), batch)  # noqa: E731
    batch = jax.ShapeDtypeStruct((4, 49), jnp.int32)
    text = jax.jit(jax.grad(loss)).trace(params, batch).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count('custom_call @__cudnn$fmhaSoftmax(') == config.n_layer
    assert text.count('custom_call @__cudnn$fmhaSoftmaxBackward(') == config.n_layer
    assert "48x48x" not in text  # no [.., T, T] array: neither the boolean mask nor a bias made from it
