"""Text samples from a model: the prompt check (before any work) and sampling with nanoGPT's sliding window."""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils

from data.tokenizer import get_tokenizer
from errors import ConfigError
from gpt2.generate import generate
from gpt2.model import GPT2


def encode_prompt(prompt: str) -> list[int]:
    """GPT-2 token ids of `prompt`; an empty prompt starts from <|endoftext|>."""
    enc = get_tokenizer()
    return enc.encode(prompt, allowed_special="all") or [enc.eot_token]


def prompt_that_fits(prompt: str, block_size: int, *, prompt_flag: str, context: str) -> list[int]:
    """The prompt's token ids, refused in one line naming the flag when they do not fit the model's context
    (`context` says which). The sampled tokens need not fit: past the context the window slides."""
    ids = encode_prompt(prompt)
    if len(ids) > block_size:
        raise ConfigError(f"{prompt_flag} encodes to {len(ids)} tokens, more than {context}; shorten it")
    return ids


def sample(model: GPT2, prompt: list[int], new_tokens: int, *, seed: int, temperature: float,
           top_k: int | None) -> str:
    """The prompt and a sampled continuation of `new_tokens` tokens, decoded; past the model's context each token
    is sampled from the last block_size tokens (nanoGPT's sliding window).

    Every process must call it (the parameters may span all of them); the text is the same everywhere.
    """
    tokens = generate(model, np.asarray([prompt]), new_tokens, key=jax.random.PRNGKey(seed),
                      temperature=temperature, top_k=top_k, slide=True)
    if jax.process_count() > 1:  # the output may be laid out over every process's devices
        tokens = multihost_utils.process_allgather(tokens, tiled=True)
    return get_tokenizer().decode(np.asarray(tokens[0]).tolist())
