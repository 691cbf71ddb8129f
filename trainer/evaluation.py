"""Validation loss and text samples: the one implementation train.py and eval.py both call."""

from __future__ import annotations

import itertools
from typing import Callable, Iterable

import jax
import numpy as np

from data.loader import to_global
from gpt2.model import GPT2
from gpt2.sharding import batch_sharding
from trainer.step import Trainer


def mean_loss(trainer: Trainer, eval_call: Callable, params, batches: Iterable[np.ndarray],
              limit: int | None) -> tuple[float, int]:
    """Mean next-token loss over the first `limit` batches ([1, B_local, T+1] each; all when None), and how
    many batches that was (0: the loss is nan). `eval_call` is `trainer.eval_call()`, built once per run."""
    rows = batch_sharding(trainer.mesh, trainer.rules, ndim=2)
    losses = [eval_call(params, to_global(local[0], rows)) for local in itertools.islice(batches, limit)]
    if not losses:
        return float("nan"), 0
    return float(np.mean(jax.device_get(losses))), len(losses)


def encode_prompt(prompt: str) -> list[int]:
    """GPT-2 token ids of `prompt`; an empty prompt starts from <|endoftext|>."""
    from data.tokenizer import get_tokenizer

    enc = get_tokenizer()
    return enc.encode(prompt, allowed_special="all") or [enc.eot_token]


def sample(model: GPT2, prompt: list[int], new_tokens: int, *, seed: int, temperature: float,
           top_k: int | None) -> str:
    """The prompt and a sampled continuation of `new_tokens` tokens, decoded."""
    from data.tokenizer import get_tokenizer
    from gpt2.generate import generate

    tokens = generate(model, np.asarray([prompt]), new_tokens, key=jax.random.PRNGKey(seed),
                      temperature=temperature, top_k=top_k)
    return get_tokenizer().decode(np.asarray(tokens[0]).tolist())
