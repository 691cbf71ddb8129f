"""Train GPT-2.

    python train.py                                   # the default: shakespeare_cpu
    python train.py --config gpt2_124m --data.dataset=/data/owt --train.batch_size=256
    python train.py --help                            # every field, with its meaning

Starting on a run directory that holds checkpoints resumes from the latest complete one, exactly.
Run the same command on every host of a TPU pod.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import time

import jax
import numpy as np
from tqdm.auto import tqdm

import configs
from configs.base import Config
from configs.cli import fail, parse
from configs.errors import CheckpointError, ConfigError, UserError
from data.loader import Corpus, corpus_identity, make_dataset, rows_consumed, to_global
from gpt2.config import ConfigError as ModelConfigError
from gpt2.sharded_init import param_report, visualize_param
from trainer.checkpoint import (Checkpoints, check_compatible, check_same_data, check_same_schedule,
                                realign_data)
from trainer import init_from
from trainer.evaluation import encode_prompt, sample
from trainer.malloc import keep_freed_memory
from trainer.metrics import MetricsLogger, peak_flops_per_device, resolve_wandb_mode
from trainer.run_dir import RunDir
from trainer.setup import (build_mesh, initialize_distributed, library_logs_to, resolve_corpus,
                           train_loader_config, val_dataset)
from trainer.spike_guard import without_streak
from trainer.trainer import Trainer


class Diverged(UserError):
    """The loss or gradient norm stopped being finite."""


class SaveFailed(CheckpointError):
    """Writing a checkpoint failed (disk full, I/O error)."""


def main(argv: list[str] | None = None) -> int:
    keep_freed_memory()  # before JAX starts its threads: see trainer/malloc.py
    argv = sys.argv[1:] if argv is None else argv
    name, argv = pop_option(argv, "--config")
    topology, argv = pop_option(argv, "--aot")
    try:
        cfg = parse(Config, argv, default=configs.load(name or configs.DEFAULT), prog="train.py", description=usage())
        cfg = init_from.resolve(cfg, argv)  # --init_from: the architecture of the HF checkpoint
        if topology:
            from trainer.aot import run_aot

            return run_aot(cfg, topology)
        return train(cfg)
    except SaveFailed as e:
        # Orbax's writer threads are mid-failure; exiting through interpreter shutdown would bury this line
        # under their tracebacks, and there is nothing left worth flushing.
        print(f"error: {e}", file=sys.stderr, flush=True)
        os._exit(2)
    except (UserError, ModelConfigError) as e:
        fail(str(e))


def usage() -> str:
    return (f"{__doc__}\nBefore the config fields below:\n"
            f"  --config NAME     the preset the other flags override: {', '.join(configs.PRESETS)}"
            f" (default {configs.DEFAULT})\n"
            "  --aot TOPOLOGY    compile the real train call for a TPU topology (v4, v5e, v5p, v6e; e.g. v5e:2x4)"
            " and report its memory, instead of training (needs the `tpu` extra)\n")


def pop_option(argv: list[str], flag: str) -> tuple[str | None, list[str]]:
    """Takes `flag VALUE` / `flag=VALUE` out of argv. `--config NAME` picks the preset the other flags
    override; `--aot TOPOLOGY` compiles for a TPU topology instead of training."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1], argv[:i] + argv[i + 2:]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1], argv[:i] + argv[i + 1:]
    return None, argv


# ---- one run ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """Everything the training loop works with."""

    cfg: Config
    trainer: Trainer
    run_dir: RunDir
    ckpt: Checkpoints
    corpus: Corpus
    train_iter: object  # Grain iterator of [B_local, T+1] batches
    logger: MetricsLogger | None = None
    meta: dict = dataclasses.field(default_factory=dict)

    def next_batches(self, n: int) -> tuple[jax.Array, np.ndarray]:
        """The next n batches as one global [K, B, T+1] array (zero-padded to K) and the [K] active mask."""
        k = self.cfg.train.steps_per_call
        local = [next(self.train_iter) for _ in range(n)]
        local += [np.zeros_like(local[0])] * (k - n)
        return to_global(np.stack(local), self.trainer.batch_sharding), np.arange(k) < n


def train(cfg: Config) -> int:
    check_sample_prompt(cfg)
    initialize_distributed(cfg.distributed)
    mesh = build_mesh(cfg)
    corpus = resolve_corpus(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.train.seq_len)
    run_dir = RunDir(cfg.run_dir)
    take_run_dir(run_dir)  # the first write to the run directory
    try:
        return _train(cfg, mesh, corpus, run_dir)
    finally:
        run_dir.unlock()


def _train(cfg: Config, mesh, corpus: Corpus, run_dir: RunDir) -> int:
    trainer = Trainer.build(cfg, mesh)
    run = Run(cfg, trainer, run_dir, Checkpoints(run_dir.path, cfg.checkpoint), corpus,
              iter(make_dataset(corpus.files("train"), cfg.model.vocab_size, train_loader_config(cfg))))
    with jax.set_mesh(mesh), library_logs_to(run_dir / "logs"):
        restored = restore(run)
        stop_after = cfg.train.stop_after
        past_stop = not restored.finished and stop_after is not None and stop_after <= restored.step
        if past_stop:
            say(f"{run_dir.path}: already at step {restored.step}, train.stop_after={stop_after}; nothing to do")
        if restored.finished or past_stop:
            run.ckpt.close()
            return 0
        state, saved, start = restored.state, restored.meta, restored.step
        wandb_mode = saved.get("wandb_mode") or resolve_wandb_mode(cfg.log.wandb)
        config = dataclasses.asdict(cfg)
        if jax.process_index() == 0:
            run_dir.record_config(config, start)
            print(summary(run, start, wandb_mode))
            if cfg.log.print_config:
                print(json.dumps(config, indent=2))
            if cfg.log.param_report:
                print(param_report(trainer.model(state["params"]), mesh))
            if cfg.log.show_sharding:
                visualize_param(trainer.model(state["params"]), cfg.log.show_sharding)
        run.logger = MetricsLogger(cfg, run_dir, wandb_id=saved.get("wandb_id"), wandb_mode=wandb_mode,
                                   start_step=start, rollbacks=saved.get("rollbacks", 0))
        run.ckpt.before_save(run.logger.sync)  # a checkpoint's records are durable before it can exist
        run.meta = {"config": config, "wandb_id": run.logger.wandb_id, "wandb_mode": wandb_mode,
                    "corpus": corpus_identity(corpus), "rollbacks": saved.get("rollbacks", 0)}
        try:
            with Preemption() as preemption:
                state = Loop(run, state, preemption).run_to_stop()
            if int(state["step"]) >= cfg.train.steps and cfg.train.sample_tokens:
                text = sample_text(cfg, trainer, state)  # every process: the parameters may span them all
                say(text)
            run.logger.plot()
        except BaseException:
            run.logger.close(quietly=True)  # the error being raised is the one to report
            raise
        run.logger.close()
        done = outputs(run, wandb_mode)
    run.ckpt.close()
    say(done)
    return 0


def summary(run: Run, start: int, wandb_mode: str) -> str:
    """The start-up screen: what runs where, in a few lines (the full config is in config.json)."""
    cfg, m, t, mesh = run.cfg, run.cfg.model, run.cfg.train, run.trainer.mesh
    meta = run.corpus.meta
    per_device = sum(np.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                     for a in jax.tree.leaves(run.trainer.abstract_params)) / 2**20
    return "\n".join([
        f"run      {run.run_dir.path} ({'resumed at step ' + str(start) if start else 'new'}; config.json)",
        f"model    {m.num_params():,} parameters: {m.n_layer} layers, {m.n_head} heads, width {m.n_embd},"
        f" context {m.block_size}, {m.dtype} compute",
        f"mesh     {mesh.size} × {jax.devices()[0].platform}: data {mesh.shape['data']} × fsdp {mesh.shape['fsdp']}"
        f" × tensor {mesh.shape['tensor']}, rules {cfg.mesh.rules} (~{per_device:,.1f} MiB of parameters per device)",
        f"data     {run.corpus.directory}: {meta.get('train_tokens', 0):,} train / {meta.get('val_tokens', 0):,}"
        " val tokens",
        f"steps    {t.steps:,} steps of {t.batch_size} × {t.seq_len} = {t.batch_size * t.seq_len:,} tokens,"
        f" {t.steps_per_call} per call; eval every {t.eval_every or t.steps}, checkpoint every"
        f" {cfg.checkpoint.every}",
        f"logs     metrics.jsonl, loss.png, logs/; wandb {wandb_mode}",
    ])


def outputs(run: Run, wandb_mode: str) -> str:
    """The end-of-run line: where everything went."""
    d = run.run_dir.path
    steps = ",".join(str(s) for s in run.ckpt.all_steps())
    where = f"checkpoints {d / 'checkpoints'}/{{{steps}}}, metrics {d / 'metrics.jsonl'}, plot {d / 'loss.png'}"
    if wandb_mode == "offline":
        where += f", wandb offline (upload: wandb sync {run.run_dir.local / 'wandb'}/offline-run-*)"
    return f"outputs: {where}"


def say(text: str) -> None:
    if jax.process_index() == 0:
        print(text)


def take_run_dir(run_dir: RunDir) -> None:
    """Process 0 takes the run directory's lock for the whole job (all processes of a job are one writer) and
    checks that checkpoints/ is writable (Orbax would otherwise stall for minutes before failing); if either
    fails, every process stops."""
    failure = None
    if jax.process_index() == 0:
        try:
            run_dir.lock()
            run_dir.check_writable("checkpoints")
        except UserError as e:
            failure = e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        if not bool(multihost_utils.broadcast_one_to_all(np.array(failure is None))):
            failure = failure or UserError(f"{run_dir.path}: process 0 could not take the run directory")
    if failure is not None:
        run_dir.unlock()
        raise failure


def check_sample_prompt(cfg: Config) -> None:
    t = cfg.train
    if t.sample_tokens:
        n = len(encode_prompt(t.sample_prompt))
        if n + t.sample_tokens > cfg.model.block_size:
            raise ConfigError(f"train.sample_prompt encodes to {n} tokens; with train.sample_tokens={t.sample_tokens}"
                              f" that exceeds model.block_size={cfg.model.block_size}")


@dataclasses.dataclass
class Restored:
    """Where a start begins: a restored or fresh state, or a run already finished."""

    step: int
    state: dict | None = None
    meta: dict = dataclasses.field(default_factory=dict)
    finished: bool = False


def restore(run: Run) -> Restored:
    """The newest checkpoint that restores (a finished run is not restored at all), or a fresh state."""
    cfg, trainer = run.cfg, run.trainer

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
        return Restored(0, trainer.init_state(init_from.load_params(cfg, trainer)))
    step, saved, state = found
    if state is None:
        say(f"{run.run_dir.path}: already finished at step {step}; train.steps={cfg.train.steps}"
            " (raise train.steps to continue it; see README, Training)")
        return Restored(step, finished=True)
    say(f"resumed from {run.ckpt.path(step)}")
    return Restored(step, state, saved)


def restore_state(run: Run, step: int, saved: dict, iterator=None) -> dict:
    """The checkpoint's train state (and, given an iterator, its data position), fitted to this run's guard."""
    guarded = saved["config"].get("guard", {}).get("skip_spikes", False)
    state = run.ckpt.restore(step, run.trainer.abstract_state(guard=guarded), iterator)
    return run.trainer.with_guard_stats(state)


# ---- the loop --------------------------------------------------------------------------------------


def steps_this_call(step: int, stop: int, cfg: Config) -> int:
    """Steps the next call takes: K, or fewer so that the call ends exactly at the next evaluation,
    checkpoint or stop (a call's steps only run where its active mask says so: no second executable)."""
    t = cfg.train
    ends = [stop, step + t.steps_per_call, (step // cfg.checkpoint.every + 1) * cfg.checkpoint.every]
    if t.eval_every:
        ends.append((step // t.eval_every + 1) * t.eval_every)
    return min(ends) - step


@dataclasses.dataclass
class Call:
    """A dispatched train call whose metrics the host has not read yet."""

    step: int  # the step it starts from
    n: int  # the steps it takes
    metrics: dict  # device arrays: read one call late
    batches: jax.Array  # [K, B, T+1]: its last batch probes the state before a save
    dispatched: float  # time.perf_counter() at dispatch


class Loop:
    """The host's side of training. JAX dispatches asynchronously, so the host reads and transfers call n+1's
    batches and dispatches it while call n runs, then reads call n's metrics (logged one call late). At an
    evaluation, a checkpoint, the stop step or a preemption the loop waits for the call instead, so those happen
    at exactly their steps; train.async_calls=False waits after every call."""

    def __init__(self, run: Run, state, preemption: "Preemption"):
        self.run, self.cfg, self.state, self.preemption = run, run.cfg, state, preemption
        t = run.cfg.train
        self.step = self.first = int(state["step"])  # the step the state reaches when the dispatched calls end
        self.stop = min(t.steps, t.stop_after or t.steps)
        self.peak = peak_flops_per_device(t.peak_flops) * jax.device_count()
        self.bar = tqdm(total=t.steps, initial=self.step, unit="step", dynamic_ncols=True,
                        disable=not (run.cfg.log.progress and run.logger.active))
        self.calls, self.last_ready = 0, 0.0
        self.evaluate = make_evaluator(run)

    def run_to_stop(self):
        call, pending = self.run.trainer.train_call(), None
        with finishing_saves(self.run.ckpt), Profile(self.run) as self.profile:
            while self.step < self.stop:
                n = steps_this_call(self.step, self.stop, self.cfg)
                batches, active = self.run.next_batches(n)  # while the previous call runs on the devices
                self.profile.before_call(self.step, n)
                self.state, metrics = call(self.state, batches, active)
                dispatched = Call(self.step, n, metrics, batches, time.perf_counter())
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
            self.bar.close()
            with save_errors(self.run.ckpt):
                self.run.ckpt.wait()
        if self.preemption.signal_name and self.run.logger.active:
            print(f"stopped by {self.preemption.signal_name} at step {self.step}; checkpoint saved, restart to resume")
        return self.state

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

    def finish(self, c: Call, *, probe: bool = False) -> bool:
        """Reads a call's metrics, checks them and logs them; False when the run rolled back instead."""
        metrics = {k: v[: c.n] if np.ndim(v) else v for k, v in jax.device_get(c.metrics).items()}  # waits
        ready = time.perf_counter()
        elapsed, self.last_ready = ready - max(c.dispatched, self.last_ready), ready
        problem = health(self.run, self.state, metrics, c.step, c.batches[c.n - 1] if probe else None)
        if problem is not None:
            self.state = None  # the abandoned calls' state: free it before a checkpoint's is restored beside it
            self.state, self.step = roll_back(self.run, problem, self.step, self.bar)
            self.last_ready = 0.0
            return False
        reached = log_call(self.run, self.bar, c.step, metrics, elapsed, self.peak)
        self.profile.after_call(reached)
        if c.step == self.first:  # the first call compiled: the ETA counts from the calls after it
            restart_bar(self.bar, reached)
        return True

    def checkpoint_and_evaluate(self, saving: bool) -> None:
        run = self.run
        if self.at_eval():
            self.evaluate(self.state["params"], self.step, self.bar)
        if saving:
            with save_errors(run.ckpt):
                run.ckpt.save(self.step, self.state, run.train_iter,
                              {**run.meta, "data_rows": rows_consumed_or_none(run)})


def restart_bar(bar, step: int) -> None:
    """The progress bar at `step`, its rate and ETA measured from now on."""
    bar.reset(total=bar.total)
    bar.initial = bar.n = bar.last_print_n = step


def log_call(run: Run, bar, step: int, metrics: dict, elapsed: float, peak: float) -> int:
    """Logs a call's steps (metrics.jsonl, wandb, the bar); returns the step reached."""
    t, n = run.cfg.train, len(metrics["loss"])
    tokens_per_s = n * t.batch_size * t.seq_len / elapsed
    mfu = tokens_per_s * run.cfg.model.flops_per_token(t.seq_len) / peak
    for i in range(n):
        step += 1
        record = {
            "step": step, "loss": number(metrics["loss"][i]), "lr": float(metrics["lr"][i]),
            "grad_norm": number(metrics["grad_norm"][i]), "tokens": step * t.batch_size * t.seq_len,
            "tokens_per_s": tokens_per_s, "mfu": mfu, "peak_flops": peak,
        }
        if run.trainer.guarded:
            record["skipped"] = int(metrics["skipped"][i])
            if record["skipped"] and run.logger.active:
                bar.write(f"step {step}: update skipped by the spike guard (loss {record['loss']}, grad_norm"
                          f" {record['grad_norm']})")
                if int(metrics["streak"][i]) == run.cfg.guard.warmup:
                    bar.write(f"step {step}: {run.cfg.guard.warmup} steps in a row skipped (guard.warmup): the loss"
                              " or gradient norm moved to a new level; the spike guard restarts its statistics")
        run.logger.log(record)
    bar.update(n)
    bar.set_postfix(loss=f"{metrics['loss'][-1]:.3f}", tok_s=f"{tokens_per_s:,.0f}", mfu=f"{mfu:.1%}")
    return step


def number(x) -> float | None:
    """A metric for JSON: None for a non-finite value (a step the spike guard skipped)."""
    return float(x) if np.isfinite(x) else None


def rows_consumed_or_none(run: Run) -> int | None:
    """Rows of the global permutation read so far (None with Grain worker processes: position kept exactly
    by Grain's own state, but it cannot be regrouped)."""
    try:
        return rows_consumed(run.train_iter, run.cfg.train.batch_size)
    except UserError:
        return None


@contextlib.contextmanager
def save_errors(ckpt: Checkpoints):
    """A failed checkpoint write (disk full, I/O error, permissions) becomes one line. Asynchronous writes
    report their failure at the next save or wait, so both go through here."""
    try:
        yield
    except (OSError, ValueError, RuntimeError) as e:
        if isinstance(e, UserError):
            raise
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SaveFailed(f"could not save checkpoint in {ckpt.directory}: {reason}") from None


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


def make_evaluator(run: Run):
    cfg, evaluator = run.cfg, run.trainer.evaluator
    val = val_dataset(run.corpus, vocab_size=cfg.model.vocab_size, seq_len=cfg.train.seq_len,
                      batch_size=cfg.train.batch_size, prefetch=cfg.data.prefetch)

    def evaluate(params, step, bar) -> float:
        val_loss, _ = evaluator.mean_loss(params, val, cfg.train.eval_batches)
        run.logger.log({"step": step, "val_loss": val_loss})
        run.logger.plot()
        if run.logger.active:
            bar.write(f"step {step}: val_loss {val_loss:.4f}")
        return val_loss

    return evaluate


# ---- numerical safety ------------------------------------------------------------------------------


def health(run: Run, state, metrics: dict, step: int, probe_batch) -> str | None:
    """None when the call's state may be trained on (and saved); otherwise what is wrong with it.

    The train call reports whether its final state is finite; before a save, the saved parameters' loss on the
    call's last batch must be finite too (huge but finite weights pass the first check and overflow in the
    next forward pass). With the spike guard a non-finite step is skipped, not fatal, and a streak of skipped
    steps asks for a rollback.
    """
    bad = ~(np.isfinite(metrics["loss"]) & np.isfinite(metrics["grad_norm"]))
    if bad.any() and not run.trainer.guarded:
        i = int(np.argmax(bad))
        return (f"training diverged at step {step + i + 1} (loss {metrics['loss'][i]}, grad_norm"
                f" {metrics['grad_norm'][i]})")
    n = len(metrics["loss"])
    if not metrics["state_finite"]:
        return f"training diverged: the parameters or optimizer moments are not finite after step {step + n}"
    g = run.cfg.guard
    if run.trainer.guarded and g.rollback_after is not None and (metrics["streak"] >= g.rollback_after).any():
        at = step + int(np.argmax(metrics["streak"] >= g.rollback_after)) + 1
        return f"the spike guard skipped {g.rollback_after} steps in a row (steps {at - g.rollback_after + 1}-{at})"
    if probe_batch is not None and not np.isfinite(float(run.trainer.evaluator.loss_call(state["params"],
                                                                                         probe_batch))):
        return f"training diverged: the parameters after step {step + n} give a non-finite loss"
    return None


def roll_back(run: Run, problem: str, abandoned_to: int, bar) -> tuple[dict, int]:
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
    if run.trainer.guarded:
        state["guard"] = without_streak(state["guard"])
    for _ in range(g.rollback_skip):
        next(run.train_iter)
    # metrics.jsonl keeps the trajectory the parameters took (as after a resume), and a record of the rollback
    run.logger.rewind(back, run.meta["rollbacks"])
    run.meta["rollbacks"] += 1
    run.logger.log({"step": back, "rollback": run.meta["rollbacks"], "reason": problem,
                    "abandoned": [back + 1, abandoned_to], "data_skipped": g.rollback_skip})
    restart_bar(bar, back)
    say(f"{problem}; rolled back to {run.ckpt.path(back)} (rollback {run.meta['rollbacks']} of"
        f" {g.max_rollbacks}), the data continues {g.rollback_skip} batches past the abandoned steps' batches")
    return state, back


def sample_text(cfg: Config, trainer: Trainer, state) -> str:
    prompt = encode_prompt(cfg.train.sample_prompt)
    text = sample(trainer.model(state["params"]), prompt, cfg.train.sample_tokens, seed=cfg.train.seed,
                  temperature=0.8, top_k=200)
    return f"--- sample ---\n{text}\n--------------"


class Profile:
    """A `jax.profiler` trace of the calls covering steps [log.profile_start, + log.profile_steps), written to
    <run_dir>/profile by process 0 (TensorBoard's profile plugin / XProf or Perfetto read it)."""

    def __init__(self, run: Run):
        log = run.cfg.log
        self.start, self.end = log.profile_start, (log.profile_start or 0) + log.profile_steps
        self.directory = run.run_dir / "profile"
        self.active = log.profile_start is not None and jax.process_index() == 0
        self.tracing = False

    def __enter__(self):
        return self

    def before_call(self, step: int, n: int) -> None:
        if self.active and not self.tracing and step < self.end and step + n >= self.start:
            jax.profiler.start_trace(str(self.directory))
            self.tracing = True

    def after_call(self, step: int) -> None:
        if self.tracing and step >= self.end - 1:
            self.__exit__()
            say(f"profile of steps {self.start}-{step}: {self.directory} (tensorboard --logdir {self.directory})")

    def __exit__(self, *exc):
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing, self.active = False, False


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


if __name__ == "__main__":
    sys.exit(main())
