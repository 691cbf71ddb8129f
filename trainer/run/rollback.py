"""What happens when a finished train call's numbers are bad: a non-finite loss or state, or a streak of steps
the spike guard skipped. `health` gives the verdict; `roll_back` restores the newest checkpoint and moves the data
past the bad batches, or ends the run in one line naming the last good checkpoint.

The spike guard inside the train call (optim/spike_guard.py) skips single bad steps; what it cannot
skip arrives here. SIGTERM is trainer/run/preemption.py's; a checkpoint that cannot be written,
trainer/storage/checkpoints.py's.
"""

from __future__ import annotations

import numpy as np

from errors import TrainingError
from trainer.processes import say
from optim.spike_guard import without_streak
from trainer.run.context import RunContext
from trainer.run.resume import restore_state
from trainer.storage.checkpoints import save_errors


class Diverged(TrainingError):
    """The loss or gradient norm stopped being finite."""


def health(run: RunContext, state, metrics: dict, step: int, probe_batch) -> str | None:
    """None when the call's state may be trained on (and saved); otherwise what is wrong with it.

    The train call reports whether its final state is finite; before a save, the saved parameters' loss on the
    call's last batch must be finite too (huge but finite weights pass the first check and overflow in the
    next forward pass). With the spike guard a non-finite step is skipped, not fatal, and a streak of skipped
    steps asks for a rollback.
    """
    # a non-finite step the spike guard did not skip (with the guard off, it skips none)
    bad = ~(np.isfinite(metrics["loss"]) & np.isfinite(metrics["grad_norm"])) & (metrics["skipped"] == 0)
    if bad.any():
        i = int(np.argmax(bad))
        return (f"training diverged at step {step + i + 1} (loss {metrics['loss'][i]}, grad_norm"
                f" {metrics['grad_norm'][i]})")
    n = len(metrics["loss"])
    if not metrics["state_finite"]:
        return f"training diverged: the parameters or optimizer moments are not finite after step {step + n}"
    g = run.cfg.guard
    if g.rollback_after is not None and (metrics["streak"] >= g.rollback_after).any():
        at = step + int(np.argmax(metrics["streak"] >= g.rollback_after)) + 1
        return f"the spike guard skipped {g.rollback_after} steps in a row (steps {at - g.rollback_after + 1}-{at})"
    if probe_batch is not None and not np.isfinite(float(run.program.evaluator.loss(state["params"], probe_batch))):
        return f"training diverged: the parameters after step {step + n} give a non-finite loss"
    return None


def roll_back(run: RunContext, problem: str, abandoned_to: int, rollbacks: int) -> tuple[dict, int, dict]:
    """Restores the newest checkpoint and moves the data `guard.rollback_skip` batches past the batches the
    abandoned steps (up to abandoned_to, the calls already dispatched) read: the iterator is already past them.
    Returns (the state, its step, the rollback's record for metrics.jsonl); without a rollback to take (`rollbacks`
    taken so far), stops the run."""
    g = run.cfg.guard
    with save_errors(run.ckpt):
        run.ckpt.wait()  # the newest checkpoint may still be in flight
    steps = run.ckpt.all_steps()
    where = f"last good checkpoint: {run.ckpt.path(steps[-1])}" if steps else "no checkpoint yet"
    if g.rollback_after is None:
        raise Diverged(f"{problem}; {where}")
    if not steps or rollbacks >= g.max_rollbacks:
        why = "no checkpoint to roll back to" if not steps else f"guard.max_rollbacks={g.max_rollbacks} reached"
        raise Diverged(f"{problem}; {why}; {where}")
    # the newest checkpoint that restores (a damaged one is moved aside, as at start-up)
    found = run.ckpt.restore_latest(lambda step, saved: restore_state(run, step, saved))
    if found is None:
        raise Diverged(f"{problem}; no checkpoint to roll back to")
    back, _, state = found
    state["opt_state"] = without_streak(state["opt_state"])
    for _ in range(g.rollback_skip):
        next(run.train_iter)
    say(f"{problem}; rolled back to {run.ckpt.path(back)} (rollback {rollbacks + 1} of {g.max_rollbacks}), the data"
        f" continues {g.rollback_skip} batches past the abandoned steps' batches")
    return state, back, {"step": back, "rollback": rollbacks + 1, "reason": problem,
                         "abandoned": [back + 1, abandoned_to], "data_skipped": g.rollback_skip}
