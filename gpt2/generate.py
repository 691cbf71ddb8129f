"""Autoregressive sampling with a KV cache (and, for checking it, without)."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gpt2.model import GPT2


def sample_logits(logits: jax.Array, key: jax.Array, temperature: float, top_k: int | None) -> jax.Array:
    """[B, V] logits -> [B] ids. temperature 0 is greedy; top_k keeps only the k most likely ids."""
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]  # [B, 1]
        logits = jnp.where(logits < kth, jnp.finfo(logits.dtype).min, logits)
    greedy = jnp.argmax(logits, axis=-1)
    sampled = jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6), axis=-1)
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


def generate(
    model: GPT2,
    prompt: jax.Array,  # [B, P] token ids
    max_new_tokens: int,
    *,
    key: jax.Array,
    temperature: float = 1.0,
    top_k: int | None = None,
    use_cache: bool = True,
    slide: bool = False,
    compiled: Callable | None = None,
) -> jax.Array:  # [B, P + max_new_tokens]
    """Samples continuations of `prompt`. Cached and uncached decoding give the same tokens.

    Past the model's context, `slide` samples each further token from the last block_size tokens, as nanoGPT's
    `generate` does (one full forward pass per token: with absolute positions no cache carries over); without
    it a prompt and max_new_tokens longer than the context are refused. `compiled`: `generate_cached` compiled
    ahead for these shapes (trainer/eval/sampling.py), called with its arguments but the static ones.
    """
    P, block = prompt.shape[1], model.config.block_size
    total = P + max_new_tokens
    if P > block or (total > block and not slide):
        raise ValueError(
            f"prompt ({P} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the"
            f" model's context of {block} tokens"
        )
    graphdef, params = nnx.split(model)
    fits = min(max_new_tokens, block - P)  # decoded within the context
    tokens = jnp.asarray(prompt, jnp.int32)
    if fits and compiled is not None:
        tokens = compiled(params, tokens, key, np.float32(temperature))
    elif fits:
        fn = generate_cached if use_cache else _generate_uncached
        tokens = fn(graphdef, params, tokens, key, jnp.float32(temperature), fits, top_k)
    if fits < max_new_tokens:
        rest = _generate_sliding(graphdef, params, tokens[:, -block:], jax.random.fold_in(key, 1),
                                 jnp.float32(temperature), max_new_tokens - fits, top_k)
        tokens = jnp.concatenate([tokens, rest], axis=1)
    return tokens


@functools.partial(jax.jit, static_argnums=(0, 5, 6))
def generate_cached(graphdef, params, prompt, key, temperature, max_new_tokens, top_k):
    """The prompt [B, P] and max_new_tokens tokens decoded after it with the KV cache, within the context."""
    model = nnx.merge(graphdef, params)
    B, P = prompt.shape
    keys = jax.random.split(key, max_new_tokens)
    cache = model.init_cache(B, P + max_new_tokens)
    logits, cache = model.decode(prompt, cache, jnp.int32(0))  # prefill: [B, P, V]
    first = sample_logits(logits[:, -1], keys[0], temperature, top_k)

    def step(carry, key):
        token, cache, index = carry
        logits, cache = model.decode(token[:, None], cache, index)  # [B, 1, V]
        nxt = sample_logits(logits[:, -1], key, temperature, top_k)
        return (nxt, cache, index + 1), nxt

    _, rest = jax.lax.scan(step, (first, cache, jnp.int32(P)), keys[1:])  # rest: [N-1, B]
    return jnp.concatenate([prompt, first[:, None], rest.T], axis=1)


@functools.partial(jax.jit, static_argnums=(0, 5, 6))
def _generate_uncached(graphdef, params, prompt, key, temperature, max_new_tokens, top_k):
    """Reference decoding: the full forward pass over a fixed-size buffer at every step."""
    model = nnx.merge(graphdef, params)
    B, P = prompt.shape
    keys = jax.random.split(key, max_new_tokens)
    tokens = jnp.zeros((B, P + max_new_tokens), jnp.int32).at[:, :P].set(prompt)

    def step(i, tokens):
        logits = model(tokens)  # causal: positions after P + i do not affect position P + i - 1
        nxt = sample_logits(logits[:, P + i - 1], keys[i], temperature, top_k)
        return tokens.at[:, P + i].set(nxt)

    return jax.lax.fori_loop(0, max_new_tokens, step, tokens)


@functools.partial(jax.jit, static_argnums=(0, 5, 6))
def _generate_sliding(graphdef, params, window, key, temperature, new_tokens, top_k):
    """`new_tokens` tokens [B, N] after `window` [B, block_size], each from the last block_size tokens."""
    model = nnx.merge(graphdef, params)

    def step(window, key):
        nxt = sample_logits(model(window)[:, -1], key, temperature, top_k)  # [B]
        return jnp.concatenate([window[:, 1:], nxt[:, None]], axis=1), nxt

    _, out = jax.lax.scan(step, window, jax.random.split(key, new_tokens))  # out: [N, B]
    return out.T
