"""The training loop: the host's side of training, from a restored state to the stop step.

JAX dispatches asynchronously, so the host reads and transfers call n+1's batches and dispatches it while call n
runs, then reads call n's metrics (logged one call late). At an evaluation, a checkpoint, the stop step or a
preemption the loop waits for the call instead, so those happen at exactly their steps; train.async_calls=False
waits after every call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from configs.base import Config
from trainer.corpus import val_dataset
from trainer.hardware import peak_flops_per_device
from trainer.processes import first_call_finished, start_up_point
from trainer.run.context import RunContext
from trainer.run.data_position import rows_consumed_or_none
from trainer.run.preemption import Preemption
from trainer.run.rollback import health, roll_back
from trainer.run.watchdog import Watchdog
from trainer.storage.checkpoints import finishing_saves, save_errors
from trainer.storage.run_dir import merge_eval_results
from trainer.telemetry.profiler import Profile


def steps_this_call(step: int, stop: int, cfg: Config) -> int:
    """Steps the next call takes: K, or fewer so that the call ends exactly at the next evaluation,
    checkpoint or stop (a call's steps only run where its active mask says so: no second executable)."""
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
    dispatched: float  # time.perf_counter() at dispatch
    accounted_from: float  # the goodput timeline's mark at dispatch: the host work since then was this call's


class TrainingLoop:
    """Runs the train call from `state` to the run's stop step, with its evaluations, checkpoints, faults and
    preemption."""

    def __init__(self, run: RunContext, state, preemption: Preemption):
        self.run, self.cfg, self.state, self.preemption = run, run.cfg, state, preemption
        t = run.cfg.train
        self.step = self.first = int(state["step"])  # the step the state reaches when the dispatched calls end
        self.stop = min(t.steps, t.stop_after or t.steps)
        self.peak = peak_flops_per_device(t.peak_flops) * jax.device_count()
        self.bar = tqdm(total=t.steps, initial=self.step, unit="step", dynamic_ncols=True,
                        disable=not (run.cfg.log.progress and run.logger.active))
        self.calls, self.last_ready, self.last_done = 0, 0.0, 0.0
        self.evaluate = make_evaluator(run)
        self.watchdog = watchdog_for(run)

    def run_to_stop(self):
        profile = Profile(self.cfg.log, self.run.run_dir / "profile", self.run.timeline)
        with finishing_saves(self.run.ckpt), profile as self.profile:
            with self.watchdog:
                self.run_calls()
            self.bar.close()
            with save_errors(self.run.ckpt), self.run.timeline.measure("checkpoint"):
                self.run.ckpt.wait()
        if self.preemption.signal_name and self.run.logger.active:
            print(f"stopped by {self.preemption.signal_name} at step {self.step}; checkpoint saved, restart to resume")
        return self.state

    def run_calls(self) -> None:
        """Dispatches train calls until the stop step (or a preemption), each one before the previous one's
        metrics are read unless a boundary needs them now."""
        call, pending = self.run.program.train_call(), None
        while self.step < self.stop:
            n = steps_this_call(self.step, self.stop, self.cfg)
            batches, active = self.next_batches(n, waiting=pending is None)
            if self.calls == 0:
                start_up_point("its first train call")  # every process there, or the late ones named
            self.profile.before_call(self.step, n)
            accounted_from = self.run.timeline.mark  # the first call compiles: the timeline carves that out
            self.state, metrics = call(self.state, batches, active)
            dispatched = DispatchedCall(self.step, n, metrics, batches, time.perf_counter(), accounted_from)
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
                    self.watchdog.beat()
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
        """Reads a call's metrics, checks them and logs them; False when the run rolled back instead."""
        metrics = {k: v[: c.n] if np.ndim(v) else v for k, v in jax.device_get(c.metrics).items()}  # waits
        ready = time.perf_counter()
        elapsed, self.last_ready = ready - max(c.dispatched, self.last_ready), ready
        skipped = int(np.sum(metrics["skipped"])) if self.run.program.guarded else 0
        checked = time.time()
        problem = health(self.run, self.state, metrics, c.step, c.batches[c.n - 1] if probe else None)
        probed = (checked, time.time()) if probe else None  # the pre-save probe (a forward pass): checkpoint work
        if problem is not None:
            self.record_call(c, skipped, probed)  # computed, and lost with the rollback
            self.state = None  # the abandoned calls' state: free it before a checkpoint's is restored beside it
            with self.run.timeline.measure("rollback"):
                self.state, self.step = roll_back(self.run, problem, self.step)
            self.run.timeline.rolled_back(self.step)
            restart_bar(self.bar, self.step)
            self.last_ready = self.last_done = 0.0
            self.watchdog.beat()
            return False
        # the call that compiled: its first execution also loads the program onto the devices, host work that
        # returns late and so shortens `elapsed` (on a GPU it read as 155 % MFU): its speed is not reported
        reached = log_call(self.run, self.bar, c.step, metrics, None if c.step == self.first else elapsed, self.peak)
        self.record_call(c, skipped, probed)
        self.profile.after_call(reached)
        if c.step == self.first:  # the first call compiled: the ETA counts from the calls after it
            restart_bar(self.bar, reached)
            first_call_finished()
        self.watchdog.beat(None if c.step == self.first else elapsed)  # a compile is no call time
        return True

    def record_call(self, c: DispatchedCall, skipped: int, probed: tuple[float, float] | None) -> None:
        """The call's time on the goodput timeline: from the timeline's latest record before its dispatch (or
        the end of the previous call's bookkeeping, if later) to now, less the pre-save probe (checkpoint
        work). The loop's host work between records (logging, the progress bar) is part of a step."""
        start = max(c.accounted_from, self.last_done)
        self.last_done = self.run.timeline.train_call(c.step, c.n, start, skipped, excluded=probed)
        if probed is not None:
            self.run.timeline.interval("checkpoint", *probed)

    def checkpoint_and_evaluate(self, saving: bool) -> None:
        run = self.run
        if self.at_eval():
            unbounded = self.watchdog.paused() if run.cfg.train.eval_tasks else contextlib.nullcontext()
            with run.timeline.measure("eval", step=self.step), unbounded:
                self.evaluate(self.state["params"], self.step, self.bar)
        if saving:
            with save_errors(run.ckpt):
                run.ckpt.save(self.step, self.state, run.train_iter,
                              {**run.meta, "data_rows": rows_consumed_or_none(run.train_iter, run.cfg.train.batch_size)})


def watchdog_for(run: RunContext) -> Watchdog:
    """The run's stall watchdog, its stacks file on a local disk (faulthandler writes to a file descriptor)."""
    d, storage = run.cfg.distributed, run.cfg.storage
    floor = d.stall_floor_seconds
    if run.run_dir.remote:  # a faltering bucket is retried for this long, then reported in one line: not a stall
        floor = max(floor, storage.retry_seconds + storage.request_timeout)
    return Watchdog(run.run_dir.local / "logs" / f"stacks.{jax.process_index()}.txt",
                    timeout=d.stall_timeout_seconds, floor=floor, process=jax.process_index(),
                    processes=jax.process_count())


def restart_bar(bar, step: int) -> None:
    """The progress bar at `step`, its rate and ETA measured from now on."""
    bar.reset(total=bar.total)
    bar.initial = bar.n = bar.last_print_n = step


def log_call(run: RunContext, bar, step: int, metrics: dict, elapsed: float | None, peak: float) -> int:
    """Logs a call's steps (metrics.jsonl, wandb, the bar); returns the step reached. Speed is None for a call
    whose time is not known (`elapsed` None)."""
    t, n = run.cfg.train, len(metrics["loss"])
    tokens_per_s = mfu = None
    if elapsed is not None:
        tokens_per_s = n * t.batch_size * t.seq_len / elapsed
        mfu = tokens_per_s * run.cfg.model.flops_per_token(t.seq_len) / peak
    for i in range(n):
        step += 1
        record = {
            "step": step, "loss": number(metrics["loss"][i]), "lr": float(metrics["lr"][i]),
            "grad_norm": number(metrics["grad_norm"][i]), "tokens": step * t.batch_size * t.seq_len,
            "tokens_per_s": tokens_per_s, "mfu": mfu, "peak_flops": peak,
        }
        if run.program.guarded:
            record["skipped"] = int(metrics["skipped"][i])
            if record["skipped"] and run.logger.active:
                bar.write(f"step {step}: update skipped by the spike guard (loss {record['loss']}, grad_norm"
                          f" {record['grad_norm']})")
                if int(metrics["streak"][i]) == run.cfg.guard.warmup:
                    bar.write(f"step {step}: {run.cfg.guard.warmup} steps in a row skipped (guard.warmup): the loss"
                              " or gradient norm moved to a new level; the spike guard restarts its statistics")
        run.logger.log(record)
    bar.update(n)
    speed = {} if elapsed is None else {"tok_s": f"{tokens_per_s:,.0f}", "mfu": f"{mfu:.1%}"}
    bar.set_postfix(loss=f"{metrics['loss'][-1]:.3f}", **speed)
    return step


def number(x) -> float | None:
    """A metric for JSON: None for a non-finite value (a step the spike guard skipped)."""
    return float(x) if np.isfinite(x) else None


def make_evaluator(run: RunContext):
    """The loop's periodic evaluation: validation loss on the same batches every time, logged and plotted."""
    cfg, evaluator = run.cfg, run.program.evaluator
    val = val_dataset(run.corpus, vocab_size=cfg.model.vocab_size, seq_len=cfg.train.seq_len,
                      batch_size=cfg.train.batch_size, prefetch=cfg.data.prefetch)

    def evaluate(params, step, bar) -> float:
        val_loss, _ = evaluator.mean_loss(params, val, cfg.train.eval_batches)
        run.logger.log({"step": step, "val_loss": val_loss})
        run.logger.plot()
        if run.logger.active:
            bar.write(f"step {step}: val_loss {val_loss:.4f}")
        if cfg.train.eval_tasks:
            benchmarks(run, params, step, bar)
        return val_loss

    return evaluate


def benchmarks(run: RunContext, params, step: int, bar) -> None:
    """train.eval_tasks at an evaluation: lm-eval through the same scorer as eval.py --tasks (one compile per
    padded shape for the whole run), into metrics.jsonl and wandb as eval/<task>/<metric>, and eval.json."""
    from trainer.eval.harness import evaluate_tasks  # lm-eval: the optional `eval` extra (checked at start-up)

    t, started = run.cfg.train, time.perf_counter()
    record = evaluate_tasks(run.program.evaluator, params, tasks=t.eval_tasks, include_path=t.include_path,
                            limit=t.eval_limit, batch_size=t.batch_size // t.grad_accum,
                            max_length=run.cfg.model.block_size, table=False, step=step)
    figures = {f"eval/{task}/{name}": value for task, metrics in record["lm_eval"].items()
               for name, value in metrics.items()}
    run.logger.log({"step": step, **figures})
    if run.logger.active:
        merge_eval_results(run.run_dir / "eval.json", [record])
        shown = "  ".join(f"{key.removeprefix('eval/')} {value:.4g}" for key, value in figures.items()
                          if not key.endswith("_stderr"))
        bar.write(f"step {step}: {shown}  ({time.perf_counter() - started:.1f} s)")
