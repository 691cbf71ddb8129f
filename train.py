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
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

import configs
from configs.base import Config
from configs.cli import fail, parse
from data.loader import make_dataset, to_global
from data.prepare import DataError
from gpt2.config import ConfigError
from gpt2.sharded import param_report, visualize_param
from trainer.checkpoint import CheckpointError, Checkpoints, check_compatible, check_same_data, realign_data
from trainer.evaluation import encode_prompt, mean_loss, sample
from trainer.host import keep_freed_memory
from trainer.metrics import MetricsLogger, peak_flops_per_device
from trainer.setup import build_mesh, initialize_distributed, resolve_corpus, train_loader_config, val_dataset
from trainer.step import Trainer


class Diverged(RuntimeError):
    """The loss or gradient norm stopped being finite."""


class SaveFailed(CheckpointError):
    """Writing a checkpoint failed (disk full, I/O error)."""


def main(argv: list[str] | None = None) -> int:
    keep_freed_memory()  # before JAX starts its threads: see trainer/host.py
    argv = sys.argv[1:] if argv is None else argv
    name, argv = pop_option(argv, "--config")
    topology, argv = pop_option(argv, "--aot")
    try:
        cfg = parse(Config, argv, default=configs.load(name or configs.DEFAULT), prog="train.py")
        if topology:
            from trainer.aot import run_aot

            return run_aot(cfg, topology)
        return train(cfg)
    except SaveFailed as e:
        # Orbax's writer threads are mid-failure; exiting through interpreter shutdown would bury this line
        # under their tracebacks, and there is nothing left worth flushing.
        print(f"error: {e}", file=sys.stderr, flush=True)
        os._exit(2)
    except (ConfigError, DataError, CheckpointError, Diverged) as e:
        fail(str(e))


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


def train(cfg: Config) -> int:
    initialize_distributed(cfg)
    mesh = build_mesh(cfg)
    corpus = resolve_corpus(cfg)
    run_dir = Path(cfg.run_dir)
    trainer = Trainer.build(cfg, mesh)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt = Checkpoints(run_dir, cfg.checkpoint)  # the first thing that writes to the run directory
    except OSError as e:
        raise CheckpointError(f"cannot write the run directory {run_dir}: {e.strerror or e}") from None
    train_iter = iter(make_dataset(corpus.files("train"), cfg.model.vocab_size, train_loader_config(cfg)))
    main_process = jax.process_index() == 0

    with jax.set_mesh(mesh):
        state, wandb_id = restore_or_init(cfg, trainer, ckpt, train_iter)
        start = int(state["step"])
        if main_process:
            write_config(run_dir, cfg)
            print(param_report(trainer.model(state["params"]), mesh))
            if cfg.log.show_sharding:
                visualize_param(trainer.model(state["params"]), cfg.log.show_sharding)
        logger = MetricsLogger(cfg, run_dir, wandb_id=wandb_id, start_step=start)
        meta = {"config": dataclasses.asdict(cfg), "wandb_id": logger.wandb_id}
        with Preemption() as preemption:
            state = loop(cfg, trainer, state, train_iter, corpus, ckpt, logger, meta, preemption)
        end = int(state["step"])
        if main_process and end >= cfg.train.steps and cfg.train.sample_tokens:
            print(sample_text(cfg, trainer, state))
        logger.plot()
        logger.close()
    ckpt.close()
    return 0


def restore_or_init(cfg, trainer: Trainer, ckpt: Checkpoints, train_iter):
    """The latest complete checkpoint (state and data position), or a fresh sharded initialization."""
    step = ckpt.latest_step()
    if step is None:
        return trainer.init_state(), None
    saved = ckpt.read_meta(step)
    check_compatible(saved, cfg, ckpt.directory)
    check_same_data(saved, cfg, ckpt.directory)
    state = ckpt.restore(step, trainer.abstract_state(), train_iter)
    realign_data(saved, cfg, train_iter, ckpt.directory)
    if jax.process_index() == 0:
        print(f"resumed from {ckpt.directory / str(step)}")
    return state, saved.get("wandb_id")


def loop(cfg: Config, trainer: Trainer, state, train_iter, corpus, ckpt, logger, meta, preemption):
    t = cfg.train
    call = trainer.train_call()
    evaluate = make_evaluator(cfg, trainer, corpus)
    step = int(state["step"])
    stop = min(t.steps, t.stop_after or t.steps)
    tokens_per_step = t.batch_size * t.seq_len
    flops_per_step = cfg.model.flops_per_token(t.seq_len) * tokens_per_step
    peak = peak_flops_per_device(t.peak_flops) * jax.device_count()
    bar = tqdm(total=t.steps, initial=step, unit="step", disable=not (cfg.log.progress and logger.active),
               dynamic_ncols=True)
    while step < stop:
        batches = to_global(next(train_iter), trainer.batch_sharding)  # [K, B, T+1]
        started = time.perf_counter()
        state, metrics = call(state, batches)
        metrics = jax.device_get(metrics)  # waits for the call: the timing below is honest
        elapsed = time.perf_counter() - started
        k = len(metrics["loss"])
        check_finite(metrics, step, ckpt)
        for i in range(k):
            step += 1
            logger.log({
                "step": step, "loss": float(metrics["loss"][i]), "lr": float(metrics["lr"][i]),
                "grad_norm": float(metrics["grad_norm"][i]), "tokens": step * tokens_per_step,
                "tokens_per_s": k * tokens_per_step / elapsed, "mfu": k * flops_per_step / elapsed / peak,
            })
        bar.update(k)
        bar.set_postfix(loss=f"{metrics['loss'][-1]:.3f}", tok_s=f"{k * tokens_per_step / elapsed:,.0f}",
                        mfu=f"{k * flops_per_step / elapsed / peak:.1%}")
        if t.eval_every and step % t.eval_every < k or step == t.steps:
            evaluate(state["params"], step, logger, bar)
        done = step >= stop or preemption.requested()
        if step % cfg.checkpoint.every < k or done:
            save(ckpt, step, state, train_iter, meta)
        if done:
            break
    bar.close()
    wait_for_saves(ckpt)
    if preemption.requested() and logger.active:
        print(f"stopped by {preemption.signal_name} at step {step}; checkpoint saved, restart to resume")
    return state


def save(ckpt: Checkpoints, step: int, state, train_iter, meta) -> None:
    """Saves (asynchronously if configured); a failed write becomes a one-line error.

    Orbax writes into a temporary directory and renames it when complete, so a failure here never damages
    the checkpoints already on disk.
    """
    with _save_errors(ckpt.directory / str(step)):
        ckpt.save(step, state, train_iter, meta, force=True)


def wait_for_saves(ckpt: Checkpoints) -> None:
    """Blocks until pending asynchronous saves are on disk (their errors surface here)."""
    with _save_errors(ckpt.directory):
        ckpt.wait()


@contextlib.contextmanager
def _save_errors(where: Path):
    try:
        yield
    except (OSError, ValueError, RuntimeError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SaveFailed(f"could not save checkpoint {where}: {reason}") from None


def make_evaluator(cfg: Config, trainer: Trainer, corpus):
    eval_call = trainer.eval_call()
    val = val_dataset(cfg, corpus, cfg.train.batch_size)

    def evaluate(params, step, logger, bar) -> float:
        val_loss, _ = mean_loss(trainer, eval_call, params, val, cfg.train.eval_batches)
        logger.log({"step": step, "val_loss": val_loss})
        logger.plot()
        if logger.active:
            bar.write(f"step {step}: val_loss {val_loss:.4f}")
        return val_loss

    return evaluate


def check_finite(metrics: dict, step: int, ckpt: Checkpoints) -> None:
    """Stops the run at the first non-finite loss or gradient norm; nothing of it is saved."""
    bad = ~(np.isfinite(metrics["loss"]) & np.isfinite(metrics["grad_norm"]))
    if bad.any():
        first = step + int(np.argmax(bad)) + 1
        wait_for_saves(ckpt)
        last = ckpt.latest_step()
        where = f"last good checkpoint: {ckpt.directory / str(last)}" if last is not None else "no checkpoint yet"
        raise Diverged(
            f"training diverged at step {first} (loss {metrics['loss'][bad][0]}, grad_norm"
            f" {metrics['grad_norm'][bad][0]}); {where}"
        )


def sample_text(cfg: Config, trainer: Trainer, state) -> str:
    prompt = encode_prompt(cfg.train.sample_prompt)
    n = min(cfg.train.sample_tokens, cfg.model.block_size - len(prompt))
    text = sample(trainer.model(state["params"]), prompt, n, seed=cfg.train.seed, temperature=0.8, top_k=200)
    return f"--- sample ---\n{text}\n--------------"


def write_config(run_dir: Path, cfg: Config) -> None:
    """The effective config, printed and saved as run_dir/config.json (atomically)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(dataclasses.asdict(cfg), indent=2)
    tmp = run_dir / ".config.json.tmp"
    tmp.write_text(text)
    os.replace(tmp, run_dir / "config.json")
    print(f"config ({run_dir / 'config.json'}):\n{text}")


class Preemption:
    """Turns SIGTERM / SIGINT into "save a checkpoint at the end of this call and exit 0"."""

    def __init__(self):
        self.signal_name = None

    def __enter__(self):
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame):
        self.signal_name = signal.Signals(signum).name

    def requested(self) -> bool:
        flag = self.signal_name is not None
        if jax.process_count() > 1:  # every process must stop at the same step
            from jax.experimental import multihost_utils

            flag = bool(np.any(multihost_utils.process_allgather(np.array(flag))))
            self.signal_name = self.signal_name or ("SIGTERM" if flag else None)
        return flag


if __name__ == "__main__":
    sys.exit(main())
