"""What happens when training meets a fault: SIGTERM / Ctrl-C (preemption), a non-finite loss or state
(numerical health and rollback), and a checkpoint that cannot be written (a full disk, an I/O error).

The spike guard inside the train call (trainer/spike_guard.py) skips single bad steps; what it cannot skip
arrives here as a verdict on a finished call.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import TYPE_CHECKING

import jax
import numpy as np

from errors import TrainingError, UserError, first_line
from trainer.checkpoint import Checkpoints
from trainer.processes import say
from trainer.resume import restore_state
from trainer.run_dir import outage_note, storage_exceptions
from trainer.spike_guard import without_streak

if TYPE_CHECKING:
    from trainer.training import TrainingRun


class Diverged(TrainingError):
    """The loss or gradient norm stopped being finite."""


class SaveFailed(TrainingError):
    """Writing a checkpoint failed (disk full, I/O error)."""

    abandon_threads = True  # Orbax's writer threads are mid-failure; nothing is left worth flushing


# ---- checkpoint writes -----------------------------------------------------------------------------


@contextlib.contextmanager
def save_errors(ckpt: Checkpoints):
    """A failed checkpoint write (disk full, I/O error, permissions) becomes one line. Asynchronous writes
    report their failure at the next save or wait, so both go through here."""
    try:
        yield
    except (ValueError, RuntimeError, *storage_exceptions()) as e:
        if isinstance(e, UserError):
            raise
        raise SaveFailed(f"could not save checkpoint in {ckpt.directory}: {first_line(e)}{outage_note()}") from None


@contextlib.contextmanager
def finishing_saves(ckpt: Checkpoints):
    """A run stopped by a user-facing error (divergence, a bad token id, a full disk at metrics.jsonl)
    first lets the checkpoint writes in flight finish, so none is abandoned half-written."""
    try:
        yield
    except UserError as e:
        if not isinstance(e, SaveFailed):
            with contextlib.suppress(Exception):
                ckpt.wait()
        raise


# ---- numerical health ------------------------------------------------------------------------------


def health(run: TrainingRun, state, metrics: dict, step: int, probe_batch) -> str | None:
    """None when the call's state may be trained on (and saved); otherwise what is wrong with it.

    The train call reports whether its final state is finite; before a save, the saved parameters' loss on the
    call's last batch must be finite too (huge but finite weights pass the first check and overflow in the
    next forward pass). With the spike guard a non-finite step is skipped, not fatal, and a streak of skipped
    steps asks for a rollback.
    """
    guarded = run.program.guarded
    bad = ~(np.isfinite(metrics["loss"]) & np.isfinite(metrics["grad_norm"]))
    if bad.any() and not guarded:
        i = int(np.argmax(bad))
        return (f"training diverged at step {step + i + 1} (loss {metrics['loss'][i]}, grad_norm"
                f" {metrics['grad_norm'][i]})")
    n = len(metrics["loss"])
    if not metrics["state_finite"]:
        return f"training diverged: the parameters or optimizer moments are not finite after step {step + n}"
    g = run.cfg.guard
    if guarded and g.rollback_after is not None and (metrics["streak"] >= g.rollback_after).any():
        at = step + int(np.argmax(metrics["streak"] >= g.rollback_after)) + 1
        return f"the spike guard skipped {g.rollback_after} steps in a row (steps {at - g.rollback_after + 1}-{at})"
    if probe_batch is not None and not np.isfinite(float(run.program.evaluator.loss_call(state["params"],
                                                                                         probe_batch))):
        return f"training diverged: the parameters after step {step + n} give a non-finite loss"
    return None


def roll_back(run: TrainingRun, problem: str, abandoned_to: int) -> tuple[dict, int]:
    """Restores the newest checkpoint and moves the data `guard.rollback_skip` batches past the batches the
    abandoned steps (up to abandoned_to, the calls already dispatched) read: the iterator is already past them.
    Without a rollback to take, stops the run."""
    g = run.cfg.guard
    with save_errors(run.ckpt):
        run.ckpt.wait()  # the newest checkpoint may still be in flight
    steps = run.ckpt.all_steps()
    where = f"last good checkpoint: {run.ckpt.path(steps[-1])}" if steps else "no checkpoint yet"
    if g.rollback_after is None:
        raise Diverged(f"{problem}; {where}")
    if not steps or run.meta["rollbacks"] >= g.max_rollbacks:
        why = "no checkpoint to roll back to" if not steps else f"guard.max_rollbacks={g.max_rollbacks} reached"
        raise Diverged(f"{problem}; {why}; {where}")
    # the newest checkpoint that restores (a damaged one is moved aside, as at start-up)
    found = run.ckpt.restore_latest(lambda step, saved: restore_state(run, step, saved))
    if found is None:
        raise Diverged(f"{problem}; no checkpoint to roll back to")
    back, _, state = found
    if run.program.guarded:
        state["guard"] = without_streak(state["guard"])
    for _ in range(g.rollback_skip):
        next(run.train_iter)
    # metrics.jsonl keeps the trajectory the parameters took (as after a resume), and a record of the rollback
    run.logger.rewind(back, run.meta["rollbacks"])
    run.meta["rollbacks"] += 1
    run.logger.log({"step": back, "rollback": run.meta["rollbacks"], "reason": problem,
                    "abandoned": [back + 1, abandoned_to], "data_skipped": g.rollback_skip})
    say(f"{problem}; rolled back to {run.ckpt.path(back)} (rollback {run.meta['rollbacks']} of"
        f" {g.max_rollbacks}), the data continues {g.rollback_skip} batches past the abandoned steps' batches")
    return state, back


# ---- preemption ------------------------------------------------------------------------------------


class Preemption:
    """Turns SIGTERM / SIGINT into "save a checkpoint at the end of a call and exit 0".

    One process: a signal handler sets a flag. Several: JAX's preemption sync point (the coordination service
    sees SIGTERM through its own handler, agrees with every process on a call by which all of them stop, and
    `reached_preemption_sync_point` says when that call is reached; Orbax's `reached_preemption` uses the same).
    SIGINT (Ctrl-C) is turned into a SIGTERM to this process so that it takes the same path; a second
    Ctrl-C stops at once (KeyboardInterrupt), for a run that hangs.
    """

    def __init__(self):
        self.signal_name = None
        self.multiprocess = jax.process_count() > 1
        self.interrupted = False

    def __enter__(self):
        signals = (signal.SIGINT,) if self.multiprocess else (signal.SIGTERM, signal.SIGINT)
        self._previous = {s: signal.signal(s, self._handle) for s in signals}
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.interrupted:  # a second Ctrl-C: stop now (a run that hangs)
            raise KeyboardInterrupt
        self.interrupted = signum == signal.SIGINT
        if self.multiprocess:
            os.kill(os.getpid(), signal.SIGTERM)  # JAX's handler: the stop is agreed with the other processes
        else:
            self.signal_name = signal.Signals(signum).name

    def requested(self, call: int) -> bool:
        """Whether to stop after call number `call` (1, 2, ... in this start; every process asks at every call)."""
        if self.multiprocess:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(call):
                self.signal_name = "SIGTERM"
        return self.signal_name is not None
