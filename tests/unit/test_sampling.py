"""Sampling past the model's context: nanoGPT's sliding window, so that the default end-of-run sample fits a model
of any block_size."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

import configs
from gpt2.config import GPT2Config
from gpt2.generate import generate
from gpt2.model import GPT2


def nanogpt_greedy(model: GPT2, idx: np.ndarray, new_tokens: int) -> np.ndarray:
    """nanoGPT's `generate` at temperature 0: the context cropped to the last block_size tokens, a full forward
    pass per token (over a block_size buffer, zero-padded while shorter: causal, so the padding changes nothing
    before it, and one compiled shape serves every step)."""
    graphdef, params = nnx.split(model)
    forward = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))  # [B, T] -> [B, T, V]
    block = model.config.block_size
    for _ in range(new_tokens):
        context = idx[:, -block:]  # [B, <= block]
        T = context.shape[1]
        logits = forward(params, np.pad(context, ((0, 0), (0, block - T))))[:, T - 1]  # [B, V]
        idx = np.concatenate([idx, np.argmax(logits, axis=-1)[:, None]], axis=1)
    return idx


@pytest.fixture(scope="module")
def model() -> GPT2:
    return GPT2(GPT2Config.nano(), rngs=nnx.Rngs(0))  # a context of 16 tokens


@pytest.mark.parametrize("use_cache", [True, False])
def test_sampling_past_the_context_slides_the_window_as_nanogpt_does(model, use_cache):
    prompt = np.array([[1, 2, 3], [4, 5, 6]])
    tokens = generate(model, prompt, 30, key=jax.random.PRNGKey(0), temperature=0.0, use_cache=use_cache, slide=True)
    np.testing.assert_array_equal(np.asarray(tokens), nanogpt_greedy(model, prompt, 30))


def test_a_sample_within_the_context_is_unchanged_by_sliding(model):
    prompt, key = np.array([[1, 2, 3], [4, 5, 6]]), jax.random.PRNGKey(3)  # the calls the test above compiled
    within = generate(model, prompt, 13, key=key, temperature=1.0)
    past = generate(model, prompt, 30, key=key, temperature=1.0, slide=True)
    assert past.shape == (2, 33)
    np.testing.assert_array_equal(np.asarray(past[:, :16]), np.asarray(within))
    with pytest.raises(ValueError, match="exceeds the model's context of 16"):
        generate(model, np.zeros((1, 17), np.int32), 1, key=key, slide=True)  # the prompt itself must fit


def test_the_default_sample_starts_with_a_small_block_size():
    """shakespeare_cpu samples 120 tokens at the end; a 64-token context used to refuse to start."""
    from trainer.run.driver import check_sample_prompt

    cfg = configs.load("shakespeare_cpu")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, block_size=64),
                              train=dataclasses.replace(cfg.train, seq_len=64))
    assert cfg.train.sample_tokens > cfg.model.block_size
    check_sample_prompt(cfg)


def test_the_end_of_run_prompt_suits_the_corpus():
    """Unset, the prompt is "ROMEO:" on the embedded Shakespeare and <|endoftext|> (an unconditional sample) on a
    corpus of the user's own; a prompt given is used as given."""
    from trainer.run.final_sample import prompt as sample_prompt

    cfg = configs.load("shakespeare_cpu")
    assert cfg.train.sample_prompt is None
    assert sample_prompt(cfg) == [33676, 4720, 25]  # "ROMEO:"
    own = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dataset="/data/mine"))
    assert sample_prompt(own) == [50256]
    given = dataclasses.replace(own, train=dataclasses.replace(cfg.train, sample_prompt="def main():"))
    assert sample_prompt(given) == [4299, 1388, 33529]
