"""Where a start begins: the newest checkpoint that restores and fits this run, or a fresh (or fine-tune's
imported) state. A resumed run continues exactly: the same parameters, optimizer moments, step, RNG and
data position as if it had never stopped.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from data.loader import corpus_identity
from trainer import init_from
from trainer.checkpoint import check_compatible, check_same_data, check_same_schedule, realign_data
from trainer.processes import say

if TYPE_CHECKING:
    from trainer.training import TrainingRun


@dataclasses.dataclass
class Restored:
    """A restored or fresh state, or a run already finished."""

    step: int
    state: dict | None = None
    meta: dict = dataclasses.field(default_factory=dict)
    finished: bool = False


def restore(run: TrainingRun) -> Restored:
    """The newest checkpoint that restores (a finished run is not restored at all), or a fresh state."""
    cfg, program = run.cfg, run.program

    def attempt(step: int, saved: dict) -> dict | None:
        check_compatible(saved, cfg, run.ckpt.path(step))
        if step >= cfg.train.steps:
            return None
        check_same_data(saved, cfg, corpus_identity(run.corpus), run.ckpt.path(step))
        check_same_schedule(saved, cfg, run.ckpt.path(step))
        state = restore_state(run, step, saved, run.train_iter)
        realign_data(saved, cfg, run.train_iter, run.ckpt.path(step))
        return state

    found = run.ckpt.restore_latest(attempt)
    if found is None:
        if cfg.init_from:
            say(f"initialized from {cfg.init_from} (Hugging Face weights; fresh optimizer)")
        return Restored(0, program.init_state(init_from.load_params(cfg, program.layout)))
    step, saved, state = found
    if state is None:
        say(f"{run.run_dir.path}: already finished at step {step}; train.steps={cfg.train.steps}"
            " (raise train.steps to continue it; see README, Training)")
        return Restored(step, finished=True)
    say(f"resumed from {run.ckpt.path(step)}")
    return Restored(step, state, saved)


def restore_state(run: TrainingRun, step: int, saved: dict, iterator=None) -> dict:
    """The checkpoint's train state (and, given an iterator, its data position), fitted to this run's guard."""
    guarded = saved["config"].get("guard", {}).get("skip_spikes", False)
    state = run.ckpt.restore(step, run.program.abstract_state(guard=guarded), iterator)
    return run.program.with_guard_stats(state)
