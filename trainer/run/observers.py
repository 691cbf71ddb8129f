"""What hangs off the training loop: reporting, the goodput record, evaluations. The loop only dispatches calls,
finishes them and rolls back (trainer/run/loop.py); at each of its named points it calls every observer, in order
(Levanter's TrainerHooks and nanodo's report_progress do the same). The profiler (trainer/telemetry/profiler.py) and
the stall watchdog (trainer/run/watchdog.py) are observers too.

The points, as the loop reaches them:
  call_dispatched(step, n)   a call of n steps from `step` is on its way to the devices
  call_finished(call)        its metrics are read and sound
  call_lost(call)            its metrics are read and are not: the run rolls back, the call is lost
  rolled_back(step, record)  the state is the checkpoint at `step` again (`record`: what metrics.jsonl keeps of it)
  evaluation(params, step)   an evaluation step (validation loss, lm-eval tasks)
  checkpoint_saved(step)     a checkpoint's save has started
"""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np
from tqdm.auto import tqdm

from errors import RUN_LOG
from trainer.corpus import val_dataset
from trainer.processes import first_call_finished, start_up_point
from trainer.program.ahead import OVERLAP_COMPILES
from trainer.run.context import RunContext
from trainer.run.watchdog import Watchdog
from trainer.storage.run_dir import merge_eval_results
from trainer.telemetry.metrics import MetricsLogger
from trainer.telemetry.profiler import Profile


@dataclasses.dataclass(frozen=True)
class FinishedCall:
    """A train call whose metrics the host has read."""

    step: int  # the step it started from
    metrics: dict  # host arrays, one value per step taken, of every metric the step reports
    elapsed: float | None  # seconds since the previous call's metrics were ready; None for the first (it compiled)
    accounted_from: float  # the goodput timeline's mark at dispatch: the host work since then was this call's
    probed: tuple[float, float] | None  # (start, end) of the pre-save probe, which is checkpoint work

    @property
    def n(self) -> int:
        return len(self.metrics["loss"])

    @property
    def reached(self) -> int:
        return self.step + self.n

    @property
    def skipped(self) -> int:
        return int(np.sum(self.metrics["skipped"]))


class Observer:
    """Does nothing at every point; an observer overrides the points it acts at."""

    def call_dispatched(self, step: int, n: int) -> None: ...

    def call_finished(self, call: FinishedCall) -> None: ...

    def call_lost(self, call: FinishedCall) -> None: ...

    def rolled_back(self, step: int, record: dict) -> None: ...

    def evaluation(self, params, step: int) -> None: ...

    def checkpoint_saved(self, step: int) -> None: ...


class StartUp(Observer):
    """The job's start-up, which trainer/processes.py bounds, ends with the first train call: every process waits
    for the others at its dispatch (a late one is named on all of them), and its end is the start-up's."""

    def call_dispatched(self, step: int, n: int) -> None:
        start_up_point("its first train call")  # nothing once the start-up is over

    def call_finished(self, call: FinishedCall) -> None:
        first_call_finished()


class CompileAhead(Observer):
    """As the first call is dispatched (its own compile is done by then), the programs the run needs later compile
    on the background thread while it trains (trainer/program/ahead.py): the evaluation's loss for the run's batches
    (also the pre-save probe's, which may come at the first call's end) and the final sample's decoding. Its first
    evaluation, probe and sample then compile nothing. Not on 2 cores or fewer (OVERLAP_COMPILES): there XLA's
    compiler and the first calls share both cores, and the default run's first step came 2 s later for it (14.5-16.3
    s against 12.3-14.3 s, benchmarks/first_step.py); those programs then compile where they are first needed."""

    def __init__(self, run: RunContext):
        self.run, self.started = run, not OVERLAP_COMPILES

    def call_dispatched(self, step: int, n: int) -> None:
        if not self.started:
            self.started = True
            t = self.run.cfg.train
            self.run.program.evaluator.compile_ahead(t.batch_size, t.seq_len)
            self.run.final_sample.compile_ahead()


class LiveSteps:
    """Each step's end as the devices reach it (the train call's host callback: TrainProgram.on_step), for the
    progress bar on a CPU, where one call of K steps can take minutes and the first holds the compile besides."""

    def __init__(self):
        self.listener = None

    def __call__(self, step: int, loss: float) -> None:
        if self.listener is not None:
            self.listener(step, loss)


class Progress(Observer):
    """Every step's metrics to metrics.jsonl and wandb (MetricsLogger), and the progress bar with its speed: moved
    at each call's end, and on a CPU at each step's (LiveSteps)."""

    WINDOW = 10  # calls the speed is measured over

    def __init__(self, run: RunContext, logger: MetricsLogger, peak_flops: float, first_step: int):
        self.run, self.logger, self.peak = run, logger, peak_flops
        self.recent: collections.deque[tuple[int, float]] = collections.deque(maxlen=self.WINDOW)  # (tokens, s)
        t = run.cfg.train
        self.bar = tqdm(total=t.steps, initial=first_step, unit="step", dynamic_ncols=True,
                        disable=not (run.cfg.log.progress and logger.active))
        if isinstance(run.program.on_step, LiveSteps):
            run.program.on_step.listener = self.step_ended

    def write(self, line: str) -> None:
        """A line above the bar, from process 0 only (and in the run's log)."""
        if self.logger.active:
            self.bar.write(line)
            RUN_LOG.info(line)

    def call_finished(self, call: FinishedCall) -> None:
        t, elapsed = self.run.cfg.train, call.elapsed
        tokens_per_s = mfu = None  # unknown for the call that compiled: its first execution also loaded it
        if elapsed is not None:
            tokens_per_s = self.speed(call.n * t.batch_size * t.seq_len, elapsed)
            mfu = tokens_per_s * self.run.cfg.model.flops_per_token(t.seq_len) / self.peak
        for i in range(call.n):
            self.logger.log(self.record(call, i, tokens_per_s, mfu))
        speed = {} if elapsed is None else {"tok_s": f"{tokens_per_s:,.0f}", "mfu": f"{mfu:.1%}"}
        with self.bar.get_lock():  # LiveSteps moves the bar from XLA's callback thread
            self.bar.set_postfix(loss=f"{call.metrics['loss'][-1]:.3f}", **speed, refresh=False)
            self.bar.update(max(0, call.reached - self.bar.n))  # the steps LiveSteps has not shown yet
            if elapsed is None:  # the first call compiled: the ETA counts from the calls after it
                self.restart_bar(call.reached)

    def step_ended(self, step: int, loss: float) -> None:
        """A step's end as the devices reach it (LiveSteps; XLA's callback thread). A step the bar has passed (a
        call's ahead of a restart of the bar, on which the main thread holds the lock) moves nothing."""
        with self.bar.get_lock():
            if step > self.bar.n:
                self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)  # shown by the update
                self.bar.update(step - self.bar.n)

    def speed(self, tokens: int, elapsed: float) -> float:
        """Tokens per second over the last WINDOW calls. One call's own time can read short (its dispatch
        blocked, or the host read the call before it late, after the devices had moved on); over consecutive
        calls those times add up to the wall time between the first one's start and the last one's end, which
        the devices cannot beat."""
        self.recent.append((tokens, elapsed))
        return sum(n for n, _ in self.recent) / sum(s for _, s in self.recent)

    def record(self, call: FinishedCall, i: int, tokens_per_s, mfu) -> dict:
        """Step call.step + i + 1's line of metrics.jsonl: every metric the step reported (and the optimizer's notes
        on it, e.g. a step the spike guard skipped, on the console)."""
        t, step = self.run.cfg.train, call.step + i + 1
        record = {"step": step, **{k: number(v[i]) for k, v in call.metrics.items() if np.ndim(v)},
                  "tokens": step * t.batch_size * t.seq_len, "tokens_per_s": tokens_per_s, "mfu": mfu,
                  "peak_flops": self.peak}
        for note in self.run.program.optimizer.notes(record):
            self.write(f"step {step}: {note}")
        return record

    def rolled_back(self, step: int, record: dict) -> None:
        # metrics.jsonl keeps the trajectory the parameters took (as after a resume), and a record of the rollback
        self.logger.rewind(step, record["rollback"] - 1)
        self.logger.log(record)
        self.restart_bar(step)

    def restart_bar(self, step: int) -> None:
        """The progress bar at `step`, its rate, ETA and speed measured from now on. (tqdm's reset draws the bar at
        step 0 before it can be moved: a resumed run's bar once read -15,606,712 step/s; it draws once, at `step`.)"""
        self.recent.clear()
        with self.bar.get_lock():
            self.bar.refresh = lambda *args, **kwargs: None  # this instance's, until deleted below
            try:
                self.bar.reset(total=self.bar.total)
            finally:
                del self.bar.refresh
            self.bar.initial = self.bar.n = self.bar.last_print_n = step
            self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def number(x) -> float | None:
    """A metric for JSON: None for a non-finite value (a step the spike guard skipped)."""
    return float(x) if np.isfinite(x) else None


class CallTimes(Observer):
    """Each call's time on the goodput timeline (events.jsonl): from the timeline's latest record before its
    dispatch (or the end of the previous call's bookkeeping, if later) to now, less the pre-save probe (checkpoint
    work). The loop's host work between records (logging, the progress bar) is part of a step; a lost call's time
    is recorded too (computed, and lost with the rollback)."""

    def __init__(self, run: RunContext):
        self.timeline, self.last_done = run.timeline, 0.0

    def call_finished(self, call: FinishedCall) -> None:
        start = max(call.accounted_from, self.last_done)
        self.last_done = self.timeline.train_call(call.step, call.n, start, call.skipped, excluded=call.probed)
        if call.probed is not None:
            self.timeline.interval("checkpoint", *call.probed)

    call_lost = call_finished

    def rolled_back(self, step: int, record: dict) -> None:
        self.timeline.rolled_back(step)
        self.last_done = 0.0


class Validation(Observer):
    """The validation loss at every evaluation, on the same batches every time: logged, plotted and shown."""

    def __init__(self, run: RunContext, logger: MetricsLogger, progress: Progress):
        cfg = run.cfg
        self.evaluator, self.batches = run.program.evaluator, cfg.train.eval_batches
        self.logger, self.progress = logger, progress
        self.val = val_dataset(run.corpus, vocab_size=cfg.model.vocab_size, seq_len=cfg.train.seq_len,
                               batch_size=cfg.train.batch_size, prefetch=cfg.data.prefetch)

    def evaluation(self, params, step: int) -> None:
        val_loss, _ = self.evaluator.mean_loss(params, self.val, self.batches)
        self.logger.log({"step": step, "val_loss": val_loss})
        self.logger.plot()
        self.progress.write(f"step {step}: val_loss {val_loss:.4f}")


class EvalTasks(Observer):
    """train.eval_tasks at every evaluation: lm-eval through the same scorer as eval.py --tasks (one compile per
    padded shape for the whole run), into metrics.jsonl and wandb as eval/<task>/<metric>, and eval.json. The stall
    watchdog is paused meanwhile: a task's length has no bound the run knows."""

    def __init__(self, run: RunContext, logger: MetricsLogger, progress: Progress, watchdog: Watchdog):
        self.run, self.logger, self.progress, self.watchdog = run, logger, progress, watchdog

    def evaluation(self, params, step: int) -> None:
        from trainer.eval.harness import evaluate_tasks  # lm-eval: the optional `eval` extra (checked at start-up)

        t, started = self.run.cfg.train, time.perf_counter()
        with self.watchdog.paused():
            record = evaluate_tasks(self.run.program.evaluator, params, tasks=t.eval_tasks,
                                    include_path=t.include_path, limit=t.eval_limit,
                                    batch_size=t.batch_size // t.grad_accum,
                                    max_length=self.run.cfg.model.block_size, table=False, step=step)
        figures = {f"eval/{task}/{name}": value for task, metrics in record["lm_eval"].items()
                   for name, value in metrics.items()}
        self.logger.log({"step": step, **figures})
        if self.logger.active:
            merge_eval_results(self.run.run_dir / "eval.json", [record])
        shown = "  ".join(f"{key.removeprefix('eval/')} {value:.4g}" for key, value in figures.items()
                          if not key.endswith("_stderr"))
        self.progress.write(f"step {step}: {shown}  ({time.perf_counter() - started:.1f} s)")


class Tracing(Observer):
    """--log.profile_start's jax.profiler trace (trainer/telemetry/profiler.py), started and stopped at calls."""

    def __init__(self, profile: Profile):
        self.profile = profile

    def call_dispatched(self, step: int, n: int) -> None:
        self.profile.before_call(step, n)

    def call_finished(self, call: FinishedCall) -> None:
        self.profile.after_call(call.reached)


class StallWatch(Observer):
    """The stall watchdog (trainer/run/watchdog.py), beaten whenever the loop finishes something: a call (its time
    sets the automatic timeout; the first call's compile is no call time), a rollback, an evaluation, a save."""

    def __init__(self, watchdog: Watchdog):
        self.watchdog = watchdog

    def call_finished(self, call: FinishedCall) -> None:
        self.watchdog.beat(call.elapsed)

    def rolled_back(self, step: int, record: dict) -> None:
        self.watchdog.beat()

    def evaluation(self, params, step: int) -> None:
        self.watchdog.beat()

    def checkpoint_saved(self, step: int) -> None:
        self.watchdog.beat()
