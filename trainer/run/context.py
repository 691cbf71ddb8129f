"""The run's shared context: what the driver builds once and the loop, resume and rollback all work with."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from configs.base import Config
from data.loader import Corpus, to_global
from trainer.program.ahead import Ahead
from trainer.program.train_program import TrainProgram
from trainer.run.final_sample import FinalSample
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
    final_sample: FinalSample  # the sample the run ends with
    @functools.cached_property
    def train_call(self) -> Ahead:
        """The train call, compiling ahead on the background thread from the first time it is asked for: resume
        asks once the start is decided (a checkpoint that fits: the compile overlaps loading its arrays; a fresh
        state: after its own program, which a CPU compiles no faster beside another), so that the compile
        overlaps the rest of the start-up; the loop's first call waits for what is left."""
        return self.program.compile_ahead()

    def start_loader(self) -> None:
        """The loader's workers start now, not at the first call's batches (3.5-6.7 s on a GPU machine, 6 s on
        this CPU with 4 workers): their start overlaps the compile. Grain's start_prefetch starts the iterators it
        has; its worker pool (an interleave of one iterator per worker) makes them when asked for its state."""
        self.train_iter.get_state()
        self.train_iter.start_prefetch()

    def next_batches(self, n: int) -> tuple[jax.Array, np.ndarray]:
        """The next n batches as one global [K, B, T+1] array (zero-padded to K) and the [K] active mask."""
        k = self.cfg.train.steps_per_call
        local = [next(self.train_iter) for _ in range(n)]
        local += [np.zeros_like(local[0])] * (k - n)
        return to_global(np.stack(local), self.program.batch_sharding), np.arange(k) < n
