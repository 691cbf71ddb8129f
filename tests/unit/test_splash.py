"""Splash attention (gpt2/splash.py): the TPU Pallas kernel, run here in Pallas's interpret mode on CPU, equals the
dense path and the kernel's own reference — forward and gradients, causal and with packed documents, in the whole
model, and sharded over a mesh. Compiled for TPU topologies with libtpu:
tests/e2e/test_splash.py.

Interpret mode is slow (it emulates the kernel's grid step by step), so shapes are GPT-2's head dim (64) with few
heads and rows. Tolerances are float32's: the kernel's online softmax sums in another order than the dense softmax.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

from gpt2 import GPT2, GPT2Config, create_sharded_model
from trainer.program.mesh import make_mesh
from gpt2.config import ConfigError
from gpt2.layers import CausalSelfAttention, attention_implementation
from gpt2.sharding import ShardingRules
from gpt2.splash import splash_attention

# Inputs and cotangents are unit normals. Observed differences: outputs <= 3e-6, gradients <= 3e-6.
FORWARD_ATOL = 5e-6
GRAD_ATOL = 1e-5


def qkv(B, T, H, K=64, seed=0):
    r = np.random.RandomState(seed)
    return [jnp.asarray(r.randn(B, T, H, K), jnp.float32) for _ in range(3)]


def two_documents(B, T, split):  # [B, T]: document 0 up to `split`, document 1 after it
    return jnp.asarray(np.broadcast_to(np.arange(T) >= split, (B, T)), jnp.int32)


def dense(q, k, v, segment_ids=None):  # the model's XLA path: causal, and documents as an explicit mask
    mask = None if segment_ids is None else (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="xla")


def kernel_reference(q, k, v, segment_ids):  # the kernel's own reference, one example's [H, T, K] at a time
    _, T, H, K = q.shape
    reference = sk.make_masked_mha_reference(sm.MultiHeadMask([sm.CausalMask((T, T))] * H))
    heads_first = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731
    ids = sk.SegmentIds(q=segment_ids, kv=segment_ids)
    out = jax.vmap(reference)(heads_first(q) / np.sqrt(K), heads_first(k), heads_first(v), ids)
    return heads_first(out)


def forward_and_grads(attention, q, k, v, segment_ids):
    """The output and d<out, w>/d(q, k, v) for a unit-normal cotangent w, in one compiled call."""
    w = jnp.asarray(np.random.RandomState(9).randn(*q.shape), jnp.float32)

    def call(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, segment_ids), q, k, v)
        return out, vjp(w)

    return jax.jit(call)(q, k, v)


def splash(block_q=512, block_kv=512, rules=None):
    return lambda q, k, v, ids: splash_attention(q, k, v, ids, block_q=block_q, block_kv=block_kv, rules=rules)


def assert_close(a, b, atol):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=atol)


@pytest.mark.parametrize("T, blocks", [(128, (512, 512)), (384, (256, 128))], ids=["T128", "T384-blocks256x128"])
def test_forward_and_gradients_equal_the_references_with_two_documents(T, blocks):
    """Two documents per row (split mid-block); T 384 shrinks the 512 default to blocks that divide it."""
    q, k, v = qkv(2, T, 2)
    ids = two_documents(2, T, split=T // 2 + 17)
    out, grads = forward_and_grads(splash(*blocks), q, k, v, ids)
    for reference in (dense, kernel_reference):
        expected, expected_grads = forward_and_grads(reference, q, k, v, ids)
        assert_close(out, expected, FORWARD_ATOL)
        for g, r in zip(grads, expected_grads):
            assert_close(g, r, GRAD_ATOL)


def test_gpt2_length_forward_equals_dense():
    """T 1024 with the default 512 blocks: the kernel skips the fully masked upper-right block."""
    q, k, v = qkv(1, 1024, 2)
    assert_close(jax.jit(splash())(q, k, v, None), dense(q, k, v), FORWARD_ATOL)


def test_a_length_off_the_128_grid_is_padded_and_still_causal():
    q, k, v = qkv(1, 200, 1)
    out = jax.jit(splash())(q, k, v, None)
    assert out.shape == q.shape
    assert_close(out, dense(q, k, v), FORWARD_ATOL)


TINY = GPT2Config(vocab_size=96, n_layer=2, n_head=2, n_embd=128, block_size=128, pad_vocab_to=128)  # K = 64


TOKENS = jnp.asarray(np.random.RandomState(0).randint(0, TINY.vocab_size, (4, TINY.block_size + 1)), jnp.int32)


def loss_and_grads(model: GPT2):
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(params):
        logits = nnx.merge(graphdef, params)(TOKENS[:, :-1])
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        return -jnp.take_along_axis(logp, TOKENS[:, 1:, None], -1).mean(), logits

    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return logits, value, {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(grads)}


@pytest.fixture(scope="module")
def dense_model_reference():
    return loss_and_grads(GPT2(dataclasses.replace(TINY, attention="xla"), rngs=nnx.Rngs(0)))


def assert_same_model_outputs(a, b):
    (la, va, ga), (lb, vb, gb) = a, b
    assert_close(la, lb, 1e-5)  # observed 6e-7 unsharded; test_model's sharded-vs-unsharded tolerances
    assert abs(float(va) - float(vb)) < 1e-5
    assert ga.keys() == gb.keys()
    for path in ga:
        assert_close(ga[path], gb[path], 1e-5)


def test_gpt2_with_splash_equals_gpt2_with_xla_attention(dense_model_reference):
    model = GPT2(dataclasses.replace(TINY, attention="splash"), rngs=nnx.Rngs(0))
    assert_same_model_outputs(loss_and_grads(model), dense_model_reference)


def test_sharded_gpt2_with_splash_equals_unsharded(dense_model_reference):
    """2×2×2 mesh, fsdp_tp: batch over data × fsdp, heads (and the weights) over tensor."""
    mesh = make_mesh(2, 2, 2)
    model = create_sharded_model(dataclasses.replace(TINY, attention="splash"), mesh, "fsdp_tp")
    with jax.set_mesh(mesh):
        assert_same_model_outputs(loss_and_grads(model), dense_model_reference)


def test_sharded_attention_runs_the_kernel_on_each_devices_batch_and_heads():
    """The shard_map's specs come from the rules: [B, T, H, K] split as (data·fsdp, -, tensor, -)."""
    config = dataclasses.replace(TINY, attention="splash", n_head=4, n_embd=256)
    mesh, rules = make_mesh(2, 2, 2), ShardingRules.preset("fsdp_tp")
    sharded = CausalSelfAttention(config, rngs=nnx.Rngs(0), rules=rules)
    plain = CausalSelfAttention(config, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.RandomState(3).randn(4, 128, config.n_embd), jnp.float32)
    ids = two_documents(4, 128, split=50)
    call = nnx.jit(lambda attn, x, ids: attn(x, segment_ids=ids)[0])
    with jax.set_mesh(mesh):
        y = call(sharded, x, ids)
        jaxpr = str(jax.make_jaxpr(lambda x: sharded(x, segment_ids=ids)[0])(x))
    assert "P(('data', 'fsdp'), None, 'tensor', None)" in jaxpr
    assert_close(y, call(plain, x, ids), FORWARD_ATOL)


def test_auto_is_xla_on_a_cpu_mesh():
    assert attention_implementation("auto", "float32", 64, 128) == "xla"  # a CPU here (tests/unit/test_attention.py:
    with jax.set_mesh(make_mesh(8, 1, 1)):  # every platform's choice)
        assert attention_implementation("auto", "bfloat16", 64, 128) == "xla"
    assert attention_implementation("splash", "float32", 64, 128) == "splash"


@pytest.mark.parametrize("field, value", [("splash_block_q", 100), ("splash_block_kv", 0), ("splash_block_q", 128.0)])
def test_block_sizes_must_be_multiples_of_128(field, value):
    with pytest.raises(ConfigError) as e:
        GPT2Config(**{field: value})
    assert str(e.value) == f"--model.{field} must be an integer > 0, a multiple of 128, got {value!r}"


def test_unknown_attention_names_the_choices():
    with pytest.raises(ConfigError, match=r"^--model.attention must be one of xla, cudnn, splash, auto, got 'flash'$"):
        GPT2Config(attention="flash")
