"""A training run from start to end: the checks before any work, joining the job, the run directory, the mesh
and program, resume, the loop, the final sample and the outputs, in that order. `train.py` parses the
configuration and calls `train`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time

import jax
import numpy as np

from configs.base import Config
from data.loader import make_dataset
from errors import UserError
from gpt2.config import check_compute_dtype
from gpt2.layers import check_attention, describe_attention
from gpt2.sharded_init import param_report, visualize_param
from trainer.corpus import resolve_corpus, train_loader_config
from trainer.eval.tasks import check_tasks
from trainer.hardware import TYPICAL_MFU, peak_flops_per_device
from trainer.program.ahead import cancel_queued
from trainer.program.memory import check_fits
from trainer.processes import failing_together, initialize_distributed, is_process_0, on_process_0, say
from trainer.program.mesh import build_mesh
from trainer.program.train_program import STATE_FORMAT, TrainProgram
from trainer.run import final_sample
from trainer.run.context import RunContext
from trainer.run.data_position import corpus_identity
from trainer.run.loop import run_to_stop
from trainer.run.observers import LiveSteps
from trainer.run.preemption import Preemption
from trainer.run.resume import Restored, restore
from trainer.storage.checkpoints import Checkpoints
from trainer.storage.compile_cache import use_compile_cache
from trainer.storage.run_dir import RunDir, open_run_dir
from trainer.telemetry import goodput
from trainer.telemetry.library_logs import keep_run_log, library_logs_to
from trainer.telemetry.metrics import MetricsLogger, resolve_wandb_mode
from trainer.telemetry.timeline import OrbaxSaveTimes, Timeline, open_timeline


def train(cfg: Config) -> int:
    """Trains (or resumes) the run `cfg` describes; 0 when it finished, stopped as asked or was preempted."""
    entered = time.time()
    check_sample_prompt(cfg)
    check_eval_tasks(cfg)
    initialize_distributed(cfg.distributed)
    joined = time.time()
    with failing_together(cfg.distributed.startup_timeout_seconds):  # from here on, one process's error ends
        # every process of the job, and the start-up is bounded
        return _build_and_run(cfg, entered, joined)


def _build_and_run(cfg: Config, entered: float, joined: float) -> int:
    """Takes the run directory, builds the run's context and runs it; the lock is released however it ends."""
    check_compute_dtype(cfg.model, jax.default_backend())  # the backend is known once the job has joined
    check_attention(cfg.model, cfg.train.seq_len)
    mesh = build_mesh(cfg)
    corpus = resolve_corpus(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.train.seq_len)
    run_dir = open_run_dir(cfg.run_dir, cfg.storage)
    take_run_dir(run_dir, cfg.storage.lock_refresh_seconds)  # the first write to the run directory
    timeline = Timeline()
    try:
        timeline = open_timeline(run_dir, entered, joined, cfg.storage.metrics_every)
        use_compile_cache(cfg.train.compile_cache, run_dir, cfg.train.compile_cache_gb)
        live = LiveSteps() if live_progress(cfg) else None
        program = TrainProgram.build(cfg, mesh, on_step=live)
        ckpt = Checkpoints(run_dir.path, cfg.checkpoint, save_statistics=OrbaxSaveTimes(timeline))
        run = RunContext(cfg, program, run_dir, ckpt, corpus,
                          iter(make_dataset(corpus.files("train"), cfg.model.vocab_size, train_loader_config(cfg))),
                          timeline, final_sample.FinalSample(cfg, program))
        timeline.interval("startup", joined)
        with jax.set_mesh(mesh), library_logs_to(run_dir / "logs"):
            _run(run)
        return 0
    except BaseException:
        with contextlib.suppress(Exception):  # the error being raised is the one to report
            timeline.end("failed")
        raise
    finally:
        run_dir.unlock()


def _run(run: RunContext) -> None:
    """Restore, start-up, the loop to its stop, the final sample, plot and goodput report."""
    with run.timeline.measure("restore"):
        restored = restore(run)
    run.timeline.restored(restored.step)
    if nothing_to_do(run, restored):
        run.ckpt.close()
        run.timeline.end("finished")
        return
    wandb_mode = restored.meta.get("wandb_mode") or resolve_wandb_mode(run.cfg.log.wandb)
    with Preemption() as preemption:  # a SIGTERM while the train call compiles is answered after its first call
        with run.timeline.measure("startup"):  # the step estimate may measure the CPU's peak: seconds, while the
            say(summary(run, restored.step, wandb_mode))  # train call compiles on the background thread
        wait_for_the_train_call(run)
        logger, meta = start_up(run, restored, wandb_mode)
        try:
            run.timeline.commit()  # the run goes ahead: this attempt's record goes to events.jsonl,
            keep_run_log()  # and its lines to its log
            state = run_to_stop(run, restored.state, preemption, logger, meta)
        except BaseException:
            cancel_queued()
            logger.close(quietly=True)  # the error being raised is the one to report
            raise
    try:
        finished = int(state["step"]) >= run.cfg.train.steps
        if not finished:
            cancel_queued()  # the sample will not be taken
        if finished and run.final_sample.wanted:
            with run.timeline.measure("sample"):
                say(run.final_sample.text(state))  # every process: the parameters may span them all
        logger.plot()
        run.timeline.since_mark("finish")  # since the final checkpoint wait, or the sample: the plot, Preemption's exit
        run.timeline.end("preempted" if preemption.signal_name else "finished" if finished else "stopped")
        report_goodput(run, logger)
    except BaseException:
        logger.close(quietly=True)  # the error being raised is the one to report
        raise
    logger.close()
    done = outputs(run, wandb_mode)
    run.ckpt.close()
    say(done)


def wait_for_the_train_call(run: RunContext) -> None:
    """Says what the wait is for, waits for the train call's compile (as one compile interval of the timeline) and
    refuses a call that cannot fit the devices' memory: before anything is written, so that such a run leaves its
    run directory as it was."""
    t, call = run.cfg.train, run.train_call
    if not call.future.done():
        say(f"compiling the train call ({t.steps_per_call} steps of {t.batch_size} × {t.seq_len} tokens)")
    with run.timeline.measure("compile", programs={}, cache_hits={}, waited=True):
        executable = call.executable()
    check_fits(executable, run.cfg)


def report_goodput(run: RunContext, logger: MetricsLogger) -> None:
    """Where the run's time went, over all its attempts so far: on the console and in wandb's summary."""
    if not is_process_0():
        return
    result = goodput.report(run.run_dir.read_events())
    say(result.text())
    if logger.wandb is not None:
        logger.wandb.summary.update(result.summary())


def nothing_to_do(run: RunContext, restored: Restored) -> bool:
    stop_after = run.cfg.train.stop_after
    past_stop = not restored.finished and stop_after is not None and stop_after <= restored.step
    if past_stop:
        say(f"{run.run_dir.path}: already at step {restored.step}, train.stop_after={stop_after}; nothing to do")
    return restored.finished or past_stop


def start_up(run: RunContext, restored: Restored, wandb_mode: str) -> tuple[MetricsLogger, dict]:
    """The config record and the start-up's details asked for; (the metrics logger, the metadata every checkpoint
    keeps)."""
    cfg, saved, start = run.cfg, restored.meta, restored.step
    config = dataclasses.asdict(cfg)
    if is_process_0():
        run.run_dir.record_config(config, start)
        if cfg.log.print_config:
            print(json.dumps(config, indent=2))
        if cfg.log.param_report:
            print(param_report(run.program.model(restored.state["params"]), run.program.mesh))
        if cfg.log.show_sharding:
            visualize_param(run.program.model(restored.state["params"]), cfg.log.show_sharding)
    logger = MetricsLogger(cfg, run.run_dir, wandb_id=saved.get("wandb_id"), wandb_mode=wandb_mode,
                           start_step=start, rollbacks=saved.get("rollbacks", 0))
    run.ckpt.before_save(logger.sync)  # a checkpoint's records are durable before it can exist
    return logger, {"config": config, "wandb_id": logger.wandb_id, "wandb_mode": wandb_mode,
                    "corpus": corpus_identity(run.corpus), "rollbacks": saved.get("rollbacks", 0),
                    "state_format": STATE_FORMAT}


def summary(run: RunContext, start: int, wandb_mode: str) -> str:
    """The start-up screen: what runs where, in a few lines (the full config is in config.json)."""
    cfg, m, t, mesh = run.cfg, run.cfg.model, run.cfg.train, run.program.mesh
    meta, slices = run.corpus.meta, cfg.mesh.num_slices
    data = f"{mesh.shape['data']}" + (f" ({slices} slices × {mesh.shape['data'] // slices})" if slices > 1 else "")
    per_device = sum(np.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                     for a in jax.tree.leaves(run.program.abstract_params)) / 2**20
    return "\n".join([
        f"run      {run.run_dir.path} ({'resumed at step ' + str(start) if start else 'new'}; config.json)",
        f"model    {m.num_params():,} parameters: {m.n_layer} layers, {m.n_head} heads, width {m.n_embd},"
        f" context {m.block_size}, {m.dtype} compute, {m.parametrization} parametrization"
        + (f" ({m.mup_summary})" if m.parametrization == "mup" else ""),
        f"attend   {describe_attention(m, t.seq_len)}",
        f"mesh     {mesh.size} × {jax.devices()[0].platform}: data {data} × fsdp {mesh.shape['fsdp']}"
        f" × tensor {mesh.shape['tensor']}, rules {cfg.mesh.rules} (~{per_device:,.1f} MiB of parameters per device)",
        f"data     {run.corpus.directory}: {meta.get('train_tokens', 0):,} train / {meta.get('val_tokens', 0):,}"
        " val tokens",
        f"optim    {cfg.optim.describe(run.program.abstract_params, m.mup_width_mult)}, schedule {cfg.schedule.name}",
        f"steps    {t.steps:,} steps of {t.batch_size} × {t.seq_len} = {t.batch_size * t.seq_len:,} tokens,"
        f" {t.steps_per_call} per call; eval every {t.eval_every or t.steps}, checkpoint every"
        f" {cfg.checkpoint.every}",
        step_estimate(cfg),
        f"logs     metrics.jsonl, loss.png, logs/; wandb {wandb_mode}",
    ])


def expected_step(cfg: Config) -> tuple[float, float, float]:
    """(seconds, FLOPs, the devices' peak FLOP/s) of a step, before the first one: its FLOPs at TYPICAL_MFU."""
    t = cfg.train
    flops = cfg.model.flops_per_token(t.seq_len) * t.batch_size * t.seq_len
    peak = peak_flops_per_device(t.peak_flops) * jax.device_count()
    return flops / (peak * TYPICAL_MFU), flops, peak


def step_estimate(cfg: Config) -> str:
    seconds, flops, peak = expected_step(cfg)
    return (f"expect   ~{seconds:.3g} s a step ({flops / 1e9:,.1f} GFLOP at {TYPICAL_MFU:.0%} of"
            f" {peak / 1e12:.3g} TFLOP/s); the first call compiles first")


LIVE_AFTER_SECONDS = 30.0


def live_progress(cfg: Config) -> bool:
    """Whether the bar moves at each step (a host callback in the train call: TrainProgram.on_step), not at each
    call: on a CPU, where a call is expected to take over LIVE_AFTER_SECONDS (gpt2_124m's 10 steps on a laptop, ~2
    minutes). JAX keeps a program with host callbacks out of its persistent cache, so the runs whose calls are short
    (the default's: ~5 s) keep theirs, and a restart of a long one compiles its train call again."""
    if not (cfg.log.progress and jax.default_backend() == "cpu"):
        return False
    return expected_step(cfg)[0] * cfg.train.steps_per_call > LIVE_AFTER_SECONDS


def outputs(run: RunContext, wandb_mode: str) -> str:
    """The end-of-run line: where everything went."""
    d = run.run_dir.path
    steps = ",".join(str(s) for s in run.ckpt.all_steps())
    where = f"checkpoints {d / 'checkpoints'}/{{{steps}}}, metrics {d / 'metrics.jsonl'}, plot {d / 'loss.png'}"
    if wandb_mode == "offline":
        where += f", wandb offline (upload: wandb sync {run.run_dir.local / 'wandb'}/offline-run-*)"
    return f"outputs: {where}"


def take_run_dir(run_dir: RunDir, refresh_every: float = 60.0) -> None:
    """Process 0 takes the run directory's lock for the whole job (all processes of a job are one writer) and
    checks that checkpoints/ is writable (Orbax would otherwise stall for minutes before failing); if either
    fails, every process stops."""

    def take() -> None:
        run_dir.lock(refresh_every)
        run_dir.check_writable("checkpoints")

    try:
        on_process_0(take, f"take the run directory {run_dir.path}")
    except UserError:
        run_dir.unlock()
        raise


def check_sample_prompt(cfg: Config) -> None:
    if cfg.train.sample_tokens:
        final_sample.prompt(cfg)


def check_eval_tasks(cfg: Config) -> None:
    """train.eval_tasks: lm-eval installed, every task known and its documents loaded, before any work."""
    t = cfg.train
    if t.eval_tasks is not None:
        check_tasks(t.eval_tasks, t.include_path, ("train.eval_tasks", "train.include_path"))
