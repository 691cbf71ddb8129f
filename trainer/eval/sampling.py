"""Text samples from a model: the prompt check (before any work) and sampling with nanoGPT's sliding window."""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from data.tokenizer import get_tokenizer
from errors import ConfigError
from gpt2.generate import generate, generate_cached
from gpt2.model import GPT2
from trainer.program.ahead import Ahead
from trainer.program.layout import ModelLayout


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


def compile_sample_ahead(layout: ModelLayout, prompt: list[int], new_tokens: int, top_k: int | None
                         ) -> Callable | None:
    """The cached decoding of `sample` for this prompt's length, compiling on the background thread
    (trainer/program/ahead.py): a run's final sample then compiles nothing. None when every token slides."""
    fits = min(new_tokens, layout.model_config.block_size - len(prompt))
    if fits <= 0:
        return None
    graphdef, params = nnx.split(layout.model(layout.abstract_params))
    replicated = NamedSharding(layout.mesh, PartitionSpec())
    shapes = [((1, len(prompt)), np.int32), ((2,), np.uint32), ((), np.float32)]  # prompt, key, temperature
    structs = [jax.ShapeDtypeStruct(shape, dtype, sharding=replicated) for shape, dtype in shapes]
    ahead = Ahead(generate_cached, layout.mesh, graphdef, params, *structs, fits, top_k)
    return lambda params, *args: ahead(params, *jax.device_put(args, replicated))


def sample(model: GPT2, prompt: list[int], new_tokens: int, *, seed: int, temperature: float,
           top_k: int | None, compiled: Callable | None = None) -> str:
    """The prompt and a sampled continuation of `new_tokens` tokens, decoded; past the model's context each token
    is sampled from the last block_size tokens (nanoGPT's sliding window). `compiled`: compile_sample_ahead's.

    Every process must call it (the parameters may span all of them); the text is the same everywhere.
    """
    tokens = generate(model, np.asarray([prompt], np.int32), new_tokens, key=jax.random.PRNGKey(seed),
                      temperature=temperature, top_k=top_k, slide=True, compiled=compiled)
    if jax.process_count() > 1:  # the output may be laid out over every process's devices
        tokens = multihost_utils.process_allgather(tokens, tiled=True)
    return get_tokenizer().decode(np.asarray(tokens)[0].tolist())
