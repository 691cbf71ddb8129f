"""model.document_mask (issue 28): attention stops at <|endoftext|>, and with document_positions the positions restart.

A packed row must give each document the logits it gets alone; a row without <|endoftext|> must give what the
unmasked model gives. A nano shape with the full GPT-2 vocabulary, so that <|endoftext|> (50256) is a token.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from data.tokenizer import EOT as TOKENIZER_EOT
from gpt2 import GPT2, GPT2Config, create_sharded_model
from trainer.program.mesh import make_mesh
from gpt2.config import GPT2_VOCAB_SIZE, ConfigError
from gpt2.generate import generate
from gpt2.model import EOT, documents

NANO = GPT2Config.nano(vocab_size=GPT2_VOCAB_SIZE)  # block_size 16
MASKED = dataclasses.replace(NANO, document_mask=True)
RESTARTED = dataclasses.replace(MASKED, document_positions=True)
R = np.random.RandomState(0)
# every input here is [2, 16]: one compile per model
PLAIN = jnp.asarray(R.randint(0, EOT, (2, 16)), jnp.int32)  # no <|endoftext|>
# row 0: the tail of a cut document (positions 0-3), then documents of 5 and 7 tokens, each opened by an <|endoftext|>
# row 1: a row that opens with an <|endoftext|> (one document)
PACKED = PLAIN.at[0, 4].set(EOT).at[0, 9].set(EOT).at[1, 0].set(EOT)
SPANS = {0: [(0, 4), (4, 9), (9, 16)], 1: [(0, 16)]}  # [start, end) of each document in each row


@functools.cache
def model_state(config: GPT2Config):  # the model of seed 0: every config here has the same parameters
    return nnx.split(GPT2(config, rngs=nnx.Rngs(0)))


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens, wpe_offset):
    model = nnx.merge(graphdef, state)
    model.wpe.embedding.set_value(jnp.roll(model.wpe.embedding[...], -wpe_offset, axis=0))
    return model(tokens)


def forward(config: GPT2Config, tokens: jax.Array, wpe_offset: int = 0) -> np.ndarray:  # [B, T, V] logits
    """Compiled logits; wpe_offset shifts the position table so that position 0 reads row `wpe_offset`: a
    document alone, at the absolute positions it had in a row."""
    return np.asarray(_forward(*model_state(config), tokens, wpe_offset))


def test_an_endoftext_opens_the_next_document():
    segment_ids, positions = documents(PACKED)
    np.testing.assert_array_equal(segment_ids[0], [0] * 4 + [1] * 5 + [2] * 7)
    np.testing.assert_array_equal(positions[0], [0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6])
    np.testing.assert_array_equal(segment_ids[1], [1] * 16)
    np.testing.assert_array_equal(positions[1], np.arange(16))


@pytest.mark.parametrize("config", [MASKED, RESTARTED], ids=["mask", "mask+positions"])
@pytest.mark.parametrize("scan", [True, False])
def test_a_row_without_a_boundary_is_the_unmasked_model_bitwise(config, scan):
    """One document per row: the mask is all-true beside the causal one, the positions are 0..T-1."""
    plain = forward(dataclasses.replace(NANO, scan_layers=scan), PLAIN)
    masked = forward(dataclasses.replace(config, scan_layers=scan), PLAIN)
    np.testing.assert_array_equal(masked, plain)


@pytest.mark.parametrize("config", [MASKED, RESTARTED], ids=["mask", "mask+positions"])
def test_each_document_of_a_packed_row_is_that_document_alone(config):
    """The reference runs each document by itself through the unmasked model: at positions from 0 with
    document_positions, else at the absolute positions it had in the row. Tolerance: the softmax sums over
    another number of keys (observed <= 2e-6)."""
    packed = forward(config, PACKED)
    for row, spans in SPANS.items():
        for start, end in spans:
            # the document, then whatever follows it (causal: later tokens change nothing before them)
            alone = jnp.pad(PACKED[row, start:], (0, start))
            offset = 0 if config.document_positions else start
            reference = forward(NANO, jnp.stack([alone, alone]), offset)[0, :end - start]
            np.testing.assert_allclose(packed[row, start:end], reference, rtol=0, atol=1e-5)
    assert not np.allclose(packed, forward(NANO, PACKED), atol=1e-3)  # and the mask did something


def loss_and_grads(config: GPT2Config, params: nnx.State | None = None):
    """Loss on the packed rows and its gradients, at `params` (default: the model's own of seed 0)."""
    graphdef, own = nnx.split(GPT2(config, rngs=nnx.Rngs(0)), nnx.Param)

    def loss(params):
        logits = nnx.merge(graphdef, params)(PACKED[:, :-1])
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        return -jnp.take_along_axis(logp, PACKED[:, 1:, None], -1).mean()

    value, grads = jax.jit(jax.value_and_grad(loss))(own if params is None else params)
    return float(value), {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(grads)}


def looped_params(scanned: GPT2Config) -> nnx.State:
    """The scanned model's parameters in the looped model's layout: h.i.* = h.*[i]."""
    flat = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(GPT2(scanned, rngs=nnx.Rngs(0)), nnx.Param))}
    looped = nnx.state(GPT2(dataclasses.replace(scanned, scan_layers=False), rngs=nnx.Rngs(0)), nnx.Param)
    for path, var in nnx.to_flat_state(looped):
        var.set_value(flat[("h", *path[2:])][path[1]] if path[0] == "h" else flat[path])
    return looped


@pytest.mark.parametrize("config", [MASKED, RESTARTED], ids=["mask", "mask+positions"])
def test_gradients_flow_and_scanned_equals_looped(config):
    value, grads = loss_and_grads(config)
    for path, g in grads.items():
        assert np.isfinite(g).all() and np.abs(g).max() > 0, path
    looped_value, looped = loss_and_grads(dataclasses.replace(config, scan_layers=False), looped_params(config))
    assert abs(value - looped_value) < 1e-5
    for path, g in grads.items():
        if path[0] == "h":  # scanned [L, ...] against the loop's h.0, h.1, ...
            g_looped = np.stack([looped[("h", i, *path[1:])] for i in range(config.n_layer)])
        else:
            g_looped = looped[path]
        np.testing.assert_allclose(g, g_looped, rtol=0, atol=1e-5)


def test_sharded_equals_unsharded():
    """The presets' setting under FSDP + tensor parallelism (2×2×2): the position table gathered for its lookup."""
    config = dataclasses.replace(RESTARTED, pad_vocab_to=128)  # a vocabulary the tensor axis can split
    tokens = jnp.concatenate([PACKED, PACKED[::-1]])  # [4, 16]: a row per data × fsdp shard
    mesh = make_mesh(2, 2, 2)
    graphdef, state = nnx.split(create_sharded_model(config, mesh, "fsdp_tp"))
    with jax.set_mesh(mesh):
        sharded = np.asarray(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, tokens))
    np.testing.assert_allclose(sharded, forward(config, tokens), rtol=0, atol=1e-5)


def test_splash_takes_the_documents_as_segment_ids():
    """The TPU path (splash, in Pallas's interpret mode here) equals the dense mask on a packed row."""
    config = dataclasses.replace(MASKED, n_head=1, n_embd=64)  # the kernel's smallest tile: head dim 64
    dense = forward(dataclasses.replace(config, attention="xla"), PACKED)
    splash = forward(dataclasses.replace(config, attention="splash"), PACKED)
    np.testing.assert_allclose(splash, dense, rtol=0, atol=1e-5)


def test_cached_decoding_is_one_document():
    """GPT2.decode draws no boundaries: a prompt and its continuation are one document (a prompt holding an
    <|endoftext|> attends across it, as HF's GPT-2 does), so sampling with the cache is the unmasked model's."""
    key, prompt = jax.random.PRNGKey(0), PACKED[:, :6]  # row 0 crosses a boundary; row 1 only opens with one
    masked = GPT2(RESTARTED, rngs=nnx.Rngs(0))
    cached = np.asarray(generate(masked, prompt, 8, key=key))
    np.testing.assert_array_equal(cached, generate(GPT2(NANO, rngs=nnx.Rngs(0)), prompt, 8, key=key))
    # a row without a boundary inside (nor a sampled one) samples what the masked full forward pass samples
    full = np.asarray(generate(masked, prompt, 8, key=key, use_cache=False))
    assert not (cached[1, 1:] == EOT).any()
    np.testing.assert_array_equal(cached[1], full[1])


def test_the_boundary_is_the_tokenizers_endoftext():
    assert EOT == TOKENIZER_EOT


@pytest.mark.parametrize("fields, message", [
    (dict(document_positions=True), "model.document_positions=true .* needs model.document_mask=true"),
    (dict(document_mask="yes"), "model.document_mask must be true or false"),
])
def test_bad_settings_name_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(NANO, **fields)
