"""Evaluation: validation loss with one jitted call built once per run, text samples, and the prompt check.

The training loop (its periodic evaluations), eval.py (every checkpoint of a run, or HF weights) and the
lm-eval scorer all use an `Evaluator`: a model layout and the compiled loss. It holds no optimizer, and
`eval.py --all` reuses its executable for every checkpoint.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Iterable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from data.loader import to_global
from errors import ConfigError
from gpt2.config import GPT2Config
from gpt2.model import GPT2, next_token_loss
from gpt2.sharding import ShardingRules
from trainer.layout import ModelLayout
from trainer.spike_guard import all_finite


@dataclasses.dataclass(frozen=True)
class Evaluator:
    layout: ModelLayout
    batch_sharding: NamedSharding  # of a [B, T + 1] batch
    loss_call: Callable  # jit(params, batch [B, T+1]) -> mean next-token loss

    @classmethod
    def build(cls, model_config: GPT2Config, mesh: Mesh, rules: ShardingRules) -> "Evaluator":
        return cls.on(ModelLayout.build(model_config, mesh, rules))

    @classmethod
    def on(cls, layout: ModelLayout) -> "Evaluator":
        batch = layout.batch_sharding(ndim=2)
        graphdef = layout.graphdef
        loss = jax.jit(lambda p, b: next_token_loss(nnx.merge(graphdef, p), b),
                       in_shardings=(layout.param_shardings, batch))
        return cls(layout, batch, loss)

    def params_finite(self, params: nnx.State) -> bool:
        return bool(_all_finite(params))

    def mean_loss(self, params, batches: Iterable[np.ndarray], limit: int | None) -> tuple[float, int]:
        """Mean next-token loss over the first `limit` batches ([B_local, T+1] each; all when None) and how
        many batches that was (0: the loss is nan)."""
        losses = [self.loss_call(params, to_global(local, self.batch_sharding))
                  for local in itertools.islice(batches, limit)]
        if not losses:
            return float("nan"), 0
        return float(np.mean(jax.device_get(losses))), len(losses)


_all_finite = jax.jit(all_finite)  # one executable for every checkpoint of `eval.py --all`


def encode_prompt(prompt: str) -> list[int]:
    """GPT-2 token ids of `prompt`; an empty prompt starts from <|endoftext|>."""
    from data.tokenizer import get_tokenizer

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
    from data.tokenizer import get_tokenizer
    from gpt2.generate import generate

    tokens = generate(model, np.asarray([prompt]), new_tokens, key=jax.random.PRNGKey(seed),
                      temperature=temperature, top_k=top_k, slide=True)
    if jax.process_count() > 1:  # the output may be laid out over every process's devices
        from jax.experimental import multihost_utils

        tokens = multihost_utils.process_allgather(tokens, tiled=True)
    return get_tokenizer().decode(np.asarray(tokens[0]).tolist())
