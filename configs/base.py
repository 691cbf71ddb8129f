"""The training application's configuration: one frozen dataclass per concern, composed into `Config`.

Presets live beside this file (`configs/shakespeare_cpu.py`, ...); any field can be overridden on the command
line: `python train.py --config gpt2_124m --model.n_layer=6 --train.batch_size=16`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from gpt2.config import ConfigError, GPT2Config
from gpt2.sharding import ShardingRules


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from.

    Attributes:
      dataset: "shakespeare" (the embedded corpus, tokenized into `cache_dir` on first use) or the
        directory of a corpus prepared with `python -m data.prepare`.
      cache_dir: where the embedded corpus is tokenized to.
      num_workers: Grain worker processes per host (0 reads in the training process).
      prefetch: batches read ahead.
      seed: data order seed (independent of the model seed).
    """

    dataset: str = "shakespeare"
    cache_dir: str = "~/.cache/gpt2_nnx/shakespeare"
    num_workers: int = 0
    prefetch: int = 2
    seed: int = 1234


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup, cosine decay to a floor, and global-norm clipping.

    Attributes:
      lr: peak learning rate.
      min_lr_ratio: the cosine floor as a fraction of `lr` (Chinchilla / nanoGPT use 0.1).
      warmup_steps: linear warmup from 0.
      decay_steps: end of the cosine (default: `train.steps`).
      b1, b2: Adam betas; 0.95 for b2 as in GPT-3 (Brown et al. 2020, appendix B).
      eps: Adam epsilon.
      weight_decay: decoupled weight decay, applied to matrices and embeddings only (not biases or norms).
      grad_clip: clip the global gradient norm to this (0 disables).
    """

    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    decay_steps: int | None = None
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes (-1: all remaining devices) and the logical-axis rules preset.

    Attributes:
      data, fsdp, tensor: mesh axis sizes; their product must be the number of devices.
      rules: one of gpt2.sharding.RULES: dp, fsdp, tp, fsdp_tp.
    """

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    rules: str = "fsdp"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The training loop.

    Attributes:
      steps: optimizer steps in total.
      batch_size: global batch (sequences per optimizer step, over all processes).
      seq_len: tokens per sequence (at most model.block_size).
      grad_accum: micro-batches per optimizer step (batch_size is split into this many).
      steps_per_call: K optimizer steps run by one jitted call (a lax.scan); logging stays per step.
      seed: model initialization and dropout seed.
      eval_every: steps between validation-loss evaluations (0: only at the end).
      eval_batches: validation batches per evaluation.
      sample_prompt: text sampled from at the end of training.
      sample_tokens: tokens generated for that sample.
      peak_flops: per-device peak FLOP/s for MFU (default: looked up from the device kind).
      stop_after: end this invocation (with a checkpoint) once this step is reached, without changing
        the schedule; a later start resumes towards `steps` (time-boxed jobs).
    """

    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    grad_accum: int = 1
    steps_per_call: int = 10
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 10
    sample_prompt: str = "ROMEO:"
    sample_tokens: int = 100
    peak_flops: float | None = None
    stop_after: int | None = None


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpointing.

    Attributes:
      every: steps between saves (a save also happens at the end); rounded up to whole train calls.
      keep: most recent checkpoints kept.
      keep_every: also keep every checkpoint whose step is a multiple of this.
      async_save: write in the background while training continues.
    """

    every: int = 500
    keep: int = 3
    keep_every: int | None = None
    async_save: bool = True


@dataclasses.dataclass(frozen=True)
class LogConfig:
    """Metrics.

    Attributes:
      wandb: "auto" (online with credentials, else offline), "online", "offline" or "disabled".
      project: wandb project.
      run_name: wandb run name (default: the run directory's name).
      progress: show a progress bar.
      show_sharding: also draw this ≤2-D parameter's layout over the devices at start-up
        (`jax.debug.visualize_array_sharding`), e.g. "wte.embedding".
    """

    wandb: Literal["auto", "online", "offline", "disabled"] = "auto"
    project: str = "gpt2-nnx"
    run_name: str | None = None
    progress: bool = True
    show_sharding: str | None = None


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Multi-process (multi-host) setup. All None: auto-detect (TPU pods, SLURM) or single process.

    Attributes:
      coordinator_address: "host:port" of process 0.
      num_processes: processes in the job.
      process_id: this process's index.
      heartbeat_timeout_seconds: a process missing this long is declared dead and the others exit with
        an error instead of waiting forever.
      initialization_timeout: seconds to wait for every process to join.
    """

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_timeout_seconds: int = 100
    initialization_timeout: int = 300


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything a training run needs. `run_dir` holds checkpoints, metrics, the config and wandb files."""

    run_dir: str = "runs/default"
    model: GPT2Config = GPT2Config.tiny()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    mesh: MeshConfig = MeshConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()
    distributed: DistributedConfig = DistributedConfig()

    def __post_init__(self):
        validate(self)


def validate(c: Config) -> None:
    """Cross-field checks; each failure names the field(s)."""
    t = c.train
    positive = {
        "train.steps": t.steps, "train.batch_size": t.batch_size, "train.seq_len": t.seq_len,
        "train.grad_accum": t.grad_accum, "train.steps_per_call": t.steps_per_call,
        "train.eval_batches": t.eval_batches, "checkpoint.every": c.checkpoint.every,
        "checkpoint.keep": c.checkpoint.keep, "optim.lr": c.optim.lr,
    }
    for name, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{name} must be positive, got {value!r}")
    nonneg = {"train.eval_every": t.eval_every, "optim.warmup_steps": c.optim.warmup_steps,
              "optim.weight_decay": c.optim.weight_decay, "optim.grad_clip": c.optim.grad_clip,
              "data.num_workers": c.data.num_workers, "data.prefetch": c.data.prefetch,
              "train.sample_tokens": t.sample_tokens}
    for name, value in nonneg.items():
        if value < 0:
            raise ConfigError(f"{name} must be >= 0, got {value!r}")
    if t.seq_len > c.model.block_size:
        raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.block_size={c.model.block_size}")
    if t.batch_size % t.grad_accum:
        raise ConfigError(f"train.grad_accum={t.grad_accum} must divide train.batch_size={t.batch_size}")
    ShardingRules.preset(c.mesh.rules)  # an unknown preset name fails here, before any work
    if not 0.0 <= c.optim.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {c.optim.min_lr_ratio}")
