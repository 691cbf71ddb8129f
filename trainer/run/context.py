"""The run's shared context: what the driver builds once and the loop, resume and rollback all work with."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from configs.base import Config
from data.loader import Corpus, to_global
from trainer.program.train_program import TrainProgram
from trainer.storage.checkpoints import Checkpoints
from trainer.storage.run_dir import RunDir
from trainer.telemetry.timeline import Timeline


@dataclasses.dataclass(frozen=True)
class RunContext:
    """One run's program, files and data: built by trainer/run/driver.py, passed to everything that runs it."""

    cfg: Config
    program: TrainProgram
    run_dir: RunDir
    ckpt: Checkpoints
    corpus: Corpus
    train_iter: object  # Grain iterator of [B_local, T+1] batches
    timeline: Timeline  # where the time goes (events.jsonl)

    def next_batches(self, n: int) -> tuple[jax.Array, np.ndarray]:
        """The next n batches as one global [K, B, T+1] array (zero-padded to K) and the [K] active mask."""
        k = self.cfg.train.steps_per_call
        local = [next(self.train_iter) for _ in range(n)]
        local += [np.zeros_like(local[0])] * (k - n)
        return to_global(np.stack(local), self.program.batch_sharding), np.arange(k) < n
