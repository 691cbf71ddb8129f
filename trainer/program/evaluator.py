"""The evaluation call: validation loss with one jitted call built once per run.

The training loop (its periodic evaluations and its pre-save probe), eval.py (every checkpoint of a run, or HF
weights) and the lm-eval scorer all use an `Evaluator`: a model layout and the compiled loss. It holds no
optimizer, and `eval.py --all` reuses its executable for every checkpoint.
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
from gpt2.config import GPT2Config
from gpt2.model import next_token_loss
from gpt2.sharding import ShardingRules
from trainer.program.ahead import Ahead
from trainer.program.layout import ModelLayout
from optim.base import all_finite


@dataclasses.dataclass(frozen=True)
class Evaluator:
    layout: ModelLayout
    batch_sharding: NamedSharding  # of a [B, T + 1] batch
    loss_call: Callable  # jit(params, batch [B, T+1]) -> mean next-token loss
    ahead: dict = dataclasses.field(default_factory=dict)  # [B, T + 1] -> its loss call compiled ahead (Ahead)

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

    def compile_ahead(self, rows: int, seq_len: int) -> None:
        """Compiles the loss for [rows, seq_len + 1] batches on the background thread (trainer/program/ahead.py):
        a run's first evaluation then compiles nothing."""
        shape = (rows, seq_len + 1)
        batch = jax.ShapeDtypeStruct(shape, np.int32, sharding=self.batch_sharding)
        self.ahead[shape] = Ahead(self.loss_call, self.layout.mesh, self.layout.abstract_params, batch)

    def loss(self, params, batch: jax.Array) -> jax.Array:
        """The mean next-token loss of one global [B, T + 1] batch (laid out as the loss call takes it), by the
        executable compiled ahead for its shape where there is one."""
        batch = jax.device_put(batch, self.batch_sharding)
        return self.ahead.get(batch.shape, self.loss_call)(params, batch)

    def params_finite(self, params: nnx.State) -> bool:
        return bool(_all_finite(params))

    def mean_loss(self, params, batches: Iterable[np.ndarray], limit: int | None) -> tuple[float, int]:
        """Mean next-token loss over the first `limit` batches ([B_local, T+1] each; all when None) and how
        many batches that was (0: the loss is nan)."""
        losses = [self.loss(params, to_global(local, self.batch_sharding))
                  for local in itertools.islice(batches, limit)]
        if not losses:
            return float("nan"), 0
        return float(np.mean(jax.device_get(losses))), len(losses)


_all_finite = jax.jit(all_finite)  # one executable for every checkpoint of `eval.py --all`
