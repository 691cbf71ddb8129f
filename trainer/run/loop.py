"""The training loop: the host's side of training, from a restored state to the stop step. It dispatches train
calls, finishes them (reads their metrics, checks them) and rolls back a bad one; everything else it does — metrics,
the progress bar, the goodput record, the profiler, the stall watchdog, evaluations — hangs off its named points as
observers (trainer/run/observers.py).

JAX dispatches asynchronously, so the host reads and transfers call n+1's batches and dispatches it while call n
runs, then reads call n's metrics (logged one call late). At an evaluation, a checkpoint, the stop step or a
preemption the loop waits for the call instead, so those happen at exactly their steps; train.async_calls=False
waits after every call.
"""

from __future__ import annotations

import dataclasses
import time

import jax

from configs.base import Config
from trainer.hardware import peak_flops_per_device
from trainer.run.context import RunContext
from trainer.run.data_position import rows_consumed_or_none
from trainer.run.observers import (CallTimes, CompileAhead, EvalTasks, FinishedCall, Observer, Progress, StallWatch,
                                   StartUp, Tracing, Validation)
from trainer.run.preemption import Preemption
from trainer.run.rollback import health, roll_back
from trainer.run.watchdog import Watchdog
from trainer.storage.checkpoints import finishing_saves, save_errors
from trainer.telemetry.metrics import MetricsLogger
from trainer.telemetry.profiler import Profile


def steps_this_call(step: int, stop: int, cfg: Config) -> int:
    """Steps the next call takes: K, or fewer so that the call ends exactly at the next evaluation,
    checkpoint or stop (its steps past them are computed and dropped by its active mask: no second executable)."""
    t = cfg.train
    ends = [stop, step + t.steps_per_call, (step // cfg.checkpoint.every + 1) * cfg.checkpoint.every]
    if t.eval_every:
        ends.append((step // t.eval_every + 1) * t.eval_every)
    return min(ends) - step


@dataclasses.dataclass
class DispatchedCall:
    """A dispatched train call whose metrics the host has not read yet."""

    step: int  # the step it starts from
    n: int  # the steps it takes
    metrics: dict  # device arrays: read one call late
    batches: jax.Array  # [K, B, T+1]: its last batch probes the state before a save
    dispatched: float  # time.perf_counter() just before its dispatch
    accounted_from: float  # the goodput timeline's mark at dispatch: the host work since then was this call's


class TrainingLoop:
    """Runs the train call from `state` to the run's stop step, with its evaluations, checkpoints, faults and
    preemption; `observers` are called at its points, in order. `meta` is what every checkpoint keeps besides the
    state (the config, the wandb run, the rollbacks taken)."""

    def __init__(self, run: RunContext, state, preemption: Preemption, observers: list[Observer], meta: dict):
        self.run, self.cfg, self.state, self.preemption = run, run.cfg, state, preemption
        self.observers, self.meta = observers, meta
        t = run.cfg.train
        self.step = self.first = int(state["step"])  # the step the state reaches when the dispatched calls end
        self.stop = min(t.steps, t.stop_after or t.steps)
        self.calls, self.known_end = 0, 0.0

    def notify(self, point: str, *args) -> None:
        for observer in self.observers:
            getattr(observer, point)(*args)

    def run_calls(self) -> None:
        """Dispatches train calls until the stop step (or a preemption), each one before the previous one's
        metrics are read unless a boundary needs them now."""
        call, pending = self.run.train_call, None  # compiled ahead (trainer/program/ahead.py)
        while self.step < self.stop:
            n = steps_this_call(self.step, self.stop, self.cfg)
            batches, active = self.next_batches(n, waiting=pending is None)
            self.notify("call_dispatched", self.step, n)
            accounted_from = self.run.timeline.mark  # the first call compiles: the timeline carves that out
            # timed from before the dispatch: a dispatch that blocks (XLA's GPU conditionals did, until the last
            # step ran) must not shorten the call's measured time
            started = time.perf_counter()
            self.state, metrics = call(self.state, batches, active)
            dispatched = DispatchedCall(self.step, n, metrics, batches, started, accounted_from)
            self.step += n
            if pending is not None and not self.finish(pending):
                pending = None  # rolled back: the call just dispatched is abandoned with it
                continue
            pending = dispatched
            saving, done = self.boundary()
            if saving or done or not self.cfg.train.async_calls or self.at_eval():
                pending = None
                if self.finish(dispatched, probe=saving):
                    self.checkpoint_and_evaluate(saving)
                    if done:
                        break

    def next_batches(self, n: int, *, waiting: bool):
        """The next call's batches: read while the previous call runs on the devices, or, when none runs
        (`waiting`: after an evaluation, a checkpoint, the first call), time the devices wait for data."""
        if not waiting:
            return self.run.next_batches(n)
        with self.run.timeline.measure("data"):
            return self.run.next_batches(n)

    def boundary(self) -> tuple[bool, bool]:
        """(save a checkpoint at self.step, stop there); every process asks at every call (preemption is agreed
        on by all of them)."""
        self.calls += 1
        preempted = self.preemption.requested(self.calls)
        done = self.step >= self.stop or preempted
        return self.step % self.cfg.checkpoint.every == 0 or done, done

    def at_eval(self) -> bool:
        t = self.cfg.train
        return bool(t.eval_every and self.step % t.eval_every == 0) or self.step == t.steps

    def finish(self, c: DispatchedCall, *, probe: bool = False) -> bool:
        """Reads a call's metrics and checks them; False when the run rolled back instead."""
        waited = not all(x.is_ready() for x in jax.tree.leaves(c.metrics))  # then `ready` is when it ended
        metrics = {k: v[: c.n] if v.ndim else v for k, v in jax.device_get(c.metrics).items()}  # waits
        ready = time.perf_counter()
        # The call ran from its dispatch, or from the previous call's end where that is known (the read waited
        # for it) and later. A call already done when read ended before `ready`: its time reads long, never short
        # (a dispatch that returned late, a host busy past it). The call that compiled: its first execution also
        # loads the program onto the devices, host work that shortens its time (on a GPU it read as 155 % MFU):
        # its time is not known.
        elapsed = None if c.step == self.first else ready - max(c.dispatched, self.known_end)
        self.known_end = ready if waited else 0.0
        checked = time.time()
        problem = health(self.run, self.state, metrics, c.step, c.batches[c.n - 1] if probe else None)
        probed = (checked, time.time()) if probe else None  # the pre-save probe (a forward pass): checkpoint work
        finished = FinishedCall(c.step, metrics, elapsed, c.accounted_from, probed)
        if problem is None:
            self.notify("call_finished", finished)
            return True
        self.notify("call_lost", finished)  # computed, and lost with the rollback
        self.state = None  # the abandoned calls' state: free it before a checkpoint's is restored beside it
        with self.run.timeline.measure("rollback"):
            self.state, self.step, record = roll_back(self.run, problem, self.step, self.meta["rollbacks"])
        self.meta["rollbacks"] = record["rollback"]
        self.known_end = 0.0
        self.notify("rolled_back", self.step, record)
        return False

    def checkpoint_and_evaluate(self, saving: bool) -> None:
        run = self.run
        if self.at_eval():
            with run.timeline.measure("eval", step=self.step):
                self.notify("evaluation", self.state["params"], self.step)
        if saving:
            with save_errors(run.ckpt):
                rows = rows_consumed_or_none(run.train_iter, run.cfg.train.batch_size)
                run.ckpt.save(self.step, self.state, run.train_iter, {**self.meta, "data_rows": rows})
            self.notify("checkpoint_saved", self.step)


def run_to_stop(run: RunContext, state, preemption: Preemption, logger: MetricsLogger, meta: dict):
    """The loop with its observers, from `state` to the stop step; the state it ends with, its saves finished."""
    cfg = run.cfg
    peak = peak_flops_per_device(cfg.train.peak_flops) * jax.device_count()
    progress = Progress(run, logger, peak, int(state["step"]))
    watchdog = watchdog_for(run)
    profile = Profile(cfg.log, run.run_dir / "profile", run.timeline)
    evaluations = [Validation(run, logger, progress)] + ([EvalTasks(run, logger, progress, watchdog)]
                                                         if cfg.train.eval_tasks else [])
    # in this order at every point: the watchdog last, so that it beats after the others' work
    observers = [StartUp(), progress, CallTimes(run), CompileAhead(run), Tracing(profile), *evaluations,
                 StallWatch(watchdog)]
    loop = TrainingLoop(run, state, preemption, observers, meta)
    run.timeline.since_mark("startup")  # wandb, the summary, the config, the evaluation's data, the peak FLOP/s
    with finishing_saves(run.ckpt), profile:
        with watchdog:
            loop.run_calls()
        progress.close()
        # the loop's exit (the watchdog's thread joined, the bar closed): once 0.34 s on a loaded machine, which
        # went unaccounted; the checkpoint wait after it is measured apart
        run.timeline.since_mark("finish")
        with save_errors(run.ckpt), run.timeline.measure("checkpoint"):
            run.ckpt.wait()
    if preemption.signal_name and logger.active:
        print(f"stopped by {preemption.signal_name} at step {loop.step}; checkpoint saved, restart to resume")
    return loop.state


def watchdog_for(run: RunContext) -> Watchdog:
    """The run's stall watchdog, its stacks file on a local disk (faulthandler writes to a file descriptor)."""
    d, storage = run.cfg.distributed, run.cfg.storage
    floor = d.stall_floor_seconds
    if run.run_dir.remote:  # a faltering bucket is retried for this long, then reported in one line: not a stall
        floor = max(floor, storage.retry_seconds + storage.request_timeout)
    return Watchdog(run.run_dir.local / "logs" / f"stacks.{jax.process_index()}.txt",
                    timeout=d.stall_timeout_seconds, floor=floor, process=jax.process_index(),
                    processes=jax.process_count())
