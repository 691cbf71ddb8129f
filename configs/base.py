"""The training application's configuration: one frozen dataclass per concern, composed into `Config`.

Presets live beside this file (`configs/shakespeare_cpu.py`, ...); any field can be overridden on the command
line: `python train.py --config gpt2_124m --model.n_layer=6 --train.batch_size=16`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from errors import ConfigError
from gpt2.config import GPT2Config
from gpt2.sharding import ShardingRules


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from.

    Attributes:
      dataset: "shakespeare" (the embedded corpus, tokenized into `cache_dir` on first use) or the
        directory of a corpus prepared with `python -m data.prepare`.
      cache_dir: where the embedded corpus is tokenized to.
      num_workers: Grain worker processes per host (>= 0; 0 reads in the training process).
      prefetch: batches read ahead (>= 0).
      seed: data order seed (>= 0; independent of the model seed).
    """

    dataset: str = "shakespeare"
    cache_dir: str = "~/.cache/gpt2_nnx/shakespeare"
    num_workers: int = 0
    prefetch: int = 2
    seed: int = 1234


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW (or Muon on the hidden matrices) with linear warmup, cosine decay to a floor, and global-norm
    clipping.

    Attributes:
      name: "adamw" for every parameter, or "muon": Muon (optax.contrib's Newton–Schulz orthogonalized momentum;
        Jordan et al., modded-nanogpt) on the attention and MLP matrices of every layer, AdamW (the fields below)
        on the embeddings and tied head, norms and biases.
      lr: peak learning rate (finite, > 0); with name=muon, the AdamW part's.
      min_lr_ratio: the cosine floor as a fraction of `lr`, in [0, 1] (Chinchilla / nanoGPT use 0.1).
      warmup_steps: linear warmup from 0 (>= 0 steps).
      decay_steps: end of the cosine (>= 1; default: `train.steps`).
      b1: Adam's first-moment decay, in [0, 1).
      b2: Adam's second-moment decay, in [0, 1); 0.95 as in GPT-3 (Brown et al. 2020, appendix B).
      eps: Adam epsilon (finite, > 0).
      weight_decay: decoupled weight decay (finite, >= 0), applied to matrices and embeddings only (not biases
        or norms).
      grad_clip: clip the global gradient norm to this (finite, >= 0; 0 disables).
      muon_lr: with name=muon, the Muon part's peak rate (finite, > 0), with the same warmup and cosine as lr.
      muon_momentum: Muon's Nesterov momentum, in [0, 1) (modded-nanogpt: 0.95).
      muon_weight_decay: decoupled weight decay of the Muon part (finite, >= 0), multiplied by its rate as in
        optax.
      muon_ns_steps: Newton–Schulz iterations (>= 1; modded-nanogpt: 5).
      muon_ns_coeffs: the Newton–Schulz quintic's (a, b, c) (modded-nanogpt's by default).
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
    name: Literal["adamw", "muon"] = "adamw"
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0
    muon_ns_steps: int = 5
    muon_ns_coeffs: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes (-1: all remaining devices) and the logical-axis rules preset.

    Attributes:
      data: pure data-parallel size (>= 1, or -1: the devices the other axes leave); the product of the
        three sizes must be the number of devices.
      fsdp: data-parallel size with parameters, gradients and optimizer state sharded over it (ZeRO-3).
      tensor: tensor-parallel size (heads, MLP and vocabulary split over it).
      rules: one of gpt2.sharding.RULES: dp, fsdp, tp, fsdp_tp.
      num_slices: TPU slices the run spans (>= 1), joined by the data-center network (DCN). The `data` axis
        spans them (slices × the data parallelism inside one); `fsdp` and `tensor` stay inside a slice, so mesh.data
        must be a multiple of it. Devices are grouped by their `slice_index` (on CPUs by process,
        consecutive processes forming a slice).
    """

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    rules: str = "fsdp"
    num_slices: int = 1


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The training loop.

    Attributes:
      steps: optimizer steps in total (>= 1); a run never takes a step past it.
      batch_size: global batch (>= 1 sequences per optimizer step, over all processes).
      seq_len: tokens per sequence (>= 1, at most model.block_size).
      grad_accum: micro-batches per optimizer step (>= 1; batch_size is split into this many).
      steps_per_call: K optimizer steps run by one jitted call (>= 1; a lax.scan); logging stays per step. A
        call stops early at an evaluation, a checkpoint or the last step, so none of them moves with K.
      seed: model initialization and dropout seed (>= 0).
      eval_every: evaluate the validation loss every this many steps (>= 0; 0: only at the last step, where
        an evaluation always runs).
      eval_batches: validation batches per evaluation (>= 1).
      sample_prompt: text sampled from at the end of training (it must fit model.block_size).
      sample_tokens: tokens generated for that sample (>= 0; 0: no sample); past model.block_size each is
        sampled from the last block_size tokens, as nanoGPT does.
      peak_flops: per-device peak FLOP/s for MFU (finite, > 0; default: looked up from the device kind).
      stop_after: end this invocation (with a checkpoint) at this step (>= 1), without changing the
        schedule; a later start resumes towards `steps` (time-boxed jobs).
      async_calls: dispatch call n+1 before reading call n's metrics, so the devices never wait for the host's
        logging, data reading and host-to-device copy (metrics are logged one call late; evaluations,
        checkpoints, the stop step and preemption still wait for their call). False: wait after every call.
      reschedule: allow a resumed run to change the learning-rate schedule (train.steps without a fixed
        optim.decay_steps, optim.lr, min_lr_ratio, warmup_steps, decay_steps): the rate then jumps to the
        new schedule's value at the resumed step. Without it such a resume is refused.
      compile_cache: JAX's persistent compilation cache, so that a restart loads its programs instead of
        compiling them again: "auto" (`<run_dir>/compile_cache`, local or gs://, shared by every process of the
        job and safe to share between jobs), a directory, or "off". A JAX_COMPILATION_CACHE_DIR set in the
        environment takes precedence over "auto".
      compile_cache_gb: the cache's size bound (> 0); the least recently used programs are evicted past it.
      eval_tasks: lm-evaluation-harness tasks (comma-separated) run at every evaluation, with the validation
        loss (None: none); needs the `eval` extra. Every task is loaded at start-up, so a task that cannot be
        (a hub dataset with no network) stops the run before training.
      eval_limit: documents per task at each evaluation (>= 1; None: all).
      include_path: a directory of lm-eval task YAMLs (local tasks need no network).
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
    async_calls: bool = True
    reschedule: bool = False
    compile_cache: str = "auto"
    compile_cache_gb: float = 4.0
    eval_tasks: str | None = None
    eval_limit: int | None = None
    include_path: str | None = None


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpointing.

    Attributes:
      every: save every this many steps (>= 1; a save also happens at the end).
      keep: most recent checkpoints kept (>= 1).
      keep_every: also keep every checkpoint whose step is a multiple of this (>= 1).
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
      print_config: also print the full effective config at start-up (it is always in config.json).
      param_report: also print every parameter's shape, logical axes, partition and bytes per device at
        start-up (the summary gives the totals).
      profile_start: capture a `jax.profiler` trace from the call that reaches this step (>= 1; None: no trace)
        into <run_dir>/profile on process 0; open it with TensorBoard's profile plugin / XProf, or Perfetto.
      profile_steps: steps the trace covers (>= 1; whole calls: rounded up to the calls that contain them).
      show_sharding: also draw this ≤2-D parameter's layout over the devices at start-up
        (`jax.debug.visualize_array_sharding`), e.g. "wte.embedding".
    """

    wandb: Literal["auto", "online", "offline", "disabled"] = "auto"
    project: str = "gpt2-nnx"
    run_name: str | None = None
    progress: bool = True
    print_config: bool = False
    param_report: bool = False
    profile_start: int | None = None
    profile_steps: int = 5
    show_sharding: str | None = None


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Multi-process (multi-host) setup. All None: JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID
    if set, else JAX's own cluster detection (Cloud TPU VMs and GKE, SLURM, Open MPI, Kubernetes), else one
    process. Explicit values override the detection.

    Attributes:
      coordinator_address: "host:port" of process 0.
      num_processes: processes in the job.
      process_id: this process's index.
      heartbeat_timeout_seconds: a process missing this long (>= 1 s) is declared dead and the others exit
        with an error instead of waiting forever.
      initialization_timeout: seconds to wait for every process to join (>= 1): then every process that can ends
        in one line naming those that did not check in (trainer/rollcall.py).
      startup_timeout_seconds: seconds from the job's forming by which every process must have finished its
        first train call (restore, build, compile: minutes on a pod; >= 0, 0: unbounded; several processes
        only). A process late to a start-up point (an agreement, the first call) is named in one line on every
        process; one stuck inside its first call ends itself 30 s after.
      stall_timeout_seconds: end the job when no train call has finished for this long (>= 0 s; one process
        too): each process that can still act writes its threads' stacks to <run_dir>/logs/stacks.<i>.txt and
        exits 2 with one line. None: max(stall_floor_seconds, 20 × the median call time), counted from the
        first call's end (its compilation is not a stall); 0: no watchdog. An evaluation or a checkpoint must
        finish within it too; train.eval_tasks' lm-eval runs pause it.
      stall_floor_seconds: the automatic stall timeout's floor (> 0); on a gs:// run directory at least
        storage.retry_seconds + storage.request_timeout, so that the storage layer reports its own failures.
    """

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_timeout_seconds: int = 100
    initialization_timeout: int = 300
    startup_timeout_seconds: float = 1800.0
    stall_timeout_seconds: float | None = None
    stall_floor_seconds: float = 300.0


@dataclasses.dataclass(frozen=True)
class StorageConfig:
    """Cloud storage (a gs:// run directory), which may falter for minutes on a pod.

    Attributes:
      retry_seconds: how long a request (a checkpoint save, a metrics append, the lock's refresh) retries a
        transient failure (HTTP 429/5xx, a refused or reset connection, no answer) with backoff before the run
        stops in one line (> 0). The newest finished checkpoint stays the newest.
      request_timeout: seconds a request to the run directory's objects (metadata, metrics, the lock, the
        checkpoint arrays) may wait for the server's next bytes before it is failed and retried (> 0): a
        connection that hangs would otherwise hang the whole job. For the arrays it sets TensorStore's
        TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS (replacing the environment's).
      metrics_every: seconds between appends of buffered metrics.jsonl records to their object (> 0; each
        checkpoint save appends first).
      lock_refresh_seconds: seconds between refreshes of the run directory's lock object (> 0); a lock not
        refreshed for 10 periods plus retry_seconds is taken over as a dead trainer's.
    """

    retry_seconds: float = 600.0
    request_timeout: float = 60.0
    metrics_every: float = 30.0
    lock_refresh_seconds: float = 60.0


@dataclasses.dataclass(frozen=True)
class GuardConfig:
    """Numerical safety beyond the check that always runs (a non-finite train state is never saved).

    The spike guard skips, inside the scanned train call, the update of a step whose loss or gradient norm is
    an outlier: its residual against the quantity's moving level (the trend) lies more than `z_loss` /
    `z_grad_norm` standard deviations above the residuals of the steps it accepted (llm.c's `-sl` / `-sg`
    outlier skip, made robust to the falling trend of the loss; see trainer/program/spike_guard.py). A skipped step
    leaves the parameters and optimizer state unchanged but still consumes its batch and its step number (the
    optimizer's own count, and so the learning-rate schedule, moves with applied updates only). A step with a
    non-finite loss or gradient norm, or whose update would make the state non-finite, is always skipped while
    the guard is on. The running statistics are part of the checkpoint.

    Attributes:
      skip_spikes: turn the spike guard on.
      z_loss: loss outlier threshold in standard deviations (finite, > 0).
      z_grad_norm: gradient-norm (before clipping) outlier threshold in standard deviations (finite, > 0).
      decay: decay of the residuals' moving mean and variance, in (0, 1) (0.99: about the last 100 accepted
        steps).
      warmup: accepted steps before the thresholds apply (>= 3; the statistics need a few residuals). As
        many skipped steps in a row restart the statistics (a new level, not a spike) and this warm-up.
      rollback_after: after this many consecutive skipped steps (>= 1), or at once when the train state is
        not finite, restore the newest checkpoint and continue with the data `rollback_skip` batches past the
        ones the abandoned steps read (PaLM, Chowdhery et al. 2022, section 5.1). None: no rollback; a
        non-finite state then stops the run.
      rollback_skip: batches skipped after the abandoned steps' batches at a rollback (>= 0).
      max_rollbacks: rollbacks one run may take (>= 1); one more stops the run.
    """

    skip_spikes: bool = False
    z_loss: float = 6.0
    z_grad_norm: float = 6.0
    decay: float = 0.99
    warmup: int = 100
    rollback_after: int | None = None
    rollback_skip: int = 100
    max_rollbacks: int = 3


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything a training run needs.

    Attributes:
      run_dir: the run directory: checkpoints, metrics.jsonl, loss.png, config.json, logs and wandb files; a
        start on a directory holding checkpoints resumes from them. A local path or gs://bucket/path (the
        gcs extra).
      init_from: start a new run from GPT-2 weights: a Hugging Face directory (config.json + safetensors, e.g.
        from `python -m tools.export_hf`) or `hub:NAME` (e.g. hub:openai-community/gpt2). Its config.json sets
        the model's architecture (a contradicting --model.* flag is an error); the optimizer starts fresh. A
        run directory holding checkpoints resumes from them, not from these weights.
    """

    run_dir: str = "runs/default"
    init_from: str | None = None
    model: GPT2Config = GPT2Config.tiny()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    mesh: MeshConfig = MeshConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    guard: GuardConfig = GuardConfig()
    log: LogConfig = LogConfig()
    distributed: DistributedConfig = DistributedConfig()
    storage: StorageConfig = StorageConfig()

    def __post_init__(self):
        validate(self)


def validate(c: Config) -> None:
    """Every bound stated in the fields' docs, and the cross-field checks; each failure names the flag."""
    t, o, ck, d = c.train, c.optim, c.checkpoint, c.distributed
    for name, value in {
        "train.steps": t.steps, "train.batch_size": t.batch_size, "train.seq_len": t.seq_len,
        "train.grad_accum": t.grad_accum, "train.steps_per_call": t.steps_per_call,
        "train.eval_batches": t.eval_batches, "checkpoint.every": ck.every, "checkpoint.keep": ck.keep,
        "checkpoint.keep_every": ck.keep_every, "train.stop_after": t.stop_after,
        "optim.decay_steps": o.decay_steps, "distributed.num_processes": d.num_processes,
        "distributed.heartbeat_timeout_seconds": d.heartbeat_timeout_seconds,
        "distributed.initialization_timeout": d.initialization_timeout,
        "log.profile_start": c.log.profile_start, "log.profile_steps": c.log.profile_steps,
        "guard.rollback_after": c.guard.rollback_after, "guard.max_rollbacks": c.guard.max_rollbacks,
        "train.eval_limit": t.eval_limit, "mesh.num_slices": c.mesh.num_slices,
    }.items():
        _integer(name, value, minimum=1)
    _integer("guard.warmup", c.guard.warmup, minimum=3)
    for name, value in {
        "train.eval_every": t.eval_every, "train.sample_tokens": t.sample_tokens, "train.seed": t.seed,
        "optim.warmup_steps": o.warmup_steps, "data.num_workers": c.data.num_workers,
        "data.prefetch": c.data.prefetch, "data.seed": c.data.seed, "distributed.process_id": d.process_id,
        "guard.rollback_skip": c.guard.rollback_skip,
    }.items():
        _integer(name, value, minimum=0)
    for name, value in {"mesh.data": c.mesh.data, "mesh.fsdp": c.mesh.fsdp, "mesh.tensor": c.mesh.tensor}.items():
        _integer(name, value, minimum=-1)
        if value == 0:
            raise ConfigError(f"{name} must be >= 1 or -1 (the rest of the devices), got 0")
    if c.mesh.data != -1 and c.mesh.data % c.mesh.num_slices:
        raise ConfigError(f"mesh.data={c.mesh.data} must be a multiple of mesh.num_slices={c.mesh.num_slices}: data"
                          " parallelism spans the slices (fsdp and tensor stay inside one)")
    _real("optim.lr", o.lr, low=0, low_open=True)
    _real("optim.eps", o.eps, low=0, low_open=True)
    _real("optim.weight_decay", o.weight_decay, low=0)
    _real("optim.grad_clip", o.grad_clip, low=0)
    _real("optim.min_lr_ratio", o.min_lr_ratio, low=0, high=1)
    _real("optim.b1", o.b1, low=0, high=1, high_open=True)
    _real("optim.b2", o.b2, low=0, high=1, high_open=True)
    _real("train.compile_cache_gb", t.compile_cache_gb, low=0, low_open=True)
    _real("optim.muon_lr", o.muon_lr, low=0, low_open=True)
    _real("optim.muon_momentum", o.muon_momentum, low=0, high=1, high_open=True)
    _real("optim.muon_weight_decay", o.muon_weight_decay, low=0)
    _integer("optim.muon_ns_steps", o.muon_ns_steps, minimum=1)
    coeffs = o.muon_ns_coeffs
    if len(coeffs) != 3 or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in coeffs):
        raise ConfigError(f"optim.muon_ns_coeffs must be three finite numbers (a, b, c), got {coeffs!r}")
    if o.name not in ("adamw", "muon"):
        raise ConfigError(f"optim.name must be 'adamw' or 'muon', got {o.name!r}")
    _real("guard.z_loss", c.guard.z_loss, low=0, low_open=True)
    _real("guard.z_grad_norm", c.guard.z_grad_norm, low=0, low_open=True)
    _real("guard.decay", c.guard.decay, low=0, high=1, low_open=True, high_open=True)
    for name in ("retry_seconds", "request_timeout", "metrics_every", "lock_refresh_seconds"):
        _real(f"storage.{name}", getattr(c.storage, name), low=0, low_open=True)
    if d.stall_timeout_seconds is not None:
        _real("distributed.stall_timeout_seconds", d.stall_timeout_seconds, low=0)
    _real("distributed.stall_floor_seconds", d.stall_floor_seconds, low=0, low_open=True)
    _real("distributed.startup_timeout_seconds", d.startup_timeout_seconds, low=0)
    if t.peak_flops is not None:
        _real("train.peak_flops", t.peak_flops, low=0, low_open=True)
    if c.model.param_dtype == "float16":
        # float16's smallest number is ~6e-8: Adam's second moment (gradients² ~1e-10) and eps (1e-8) become 0
        raise ConfigError("model.param_dtype=float16 cannot be trained: the optimizer state is kept in it and "
                          "underflows (the loss turns NaN within steps); use float32 or bfloat16, and "
                          "model.dtype for the compute")
    if t.seq_len > c.model.block_size:
        raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.block_size={c.model.block_size}")
    if t.batch_size % t.grad_accum:
        raise ConfigError(f"train.grad_accum={t.grad_accum} must divide train.batch_size={t.batch_size}")
    if d.num_processes is not None and d.process_id is not None and d.process_id >= d.num_processes:
        raise ConfigError(f"distributed.process_id={d.process_id} must be < distributed.num_processes="
                          f"{d.num_processes}")
    ShardingRules.preset(c.mesh.rules)  # an unknown preset name fails here, before any work


def _integer(name: str, value, *, minimum: int) -> None:
    """None (unset) passes; otherwise an int >= minimum."""
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _real(name: str, value, *, low=None, high=None, low_open=False, high_open=False) -> None:
    """A finite number within [low, high] (or open at either end)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (low is None or (value > low if low_open else value >= low))
    ok = ok and (high is None or (value < high if high_open else value <= high))
    if not ok:
        lo = "" if low is None else f"{'(' if low_open else '['}{low}"
        hi = "" if high is None else f"{high}{')' if high_open else ']'}"
        where = f"in {lo}, {hi}" if low is not None and high is not None else (f"> {low}" if low_open else f">= {low}")
        raise ConfigError(f"{name} must be a finite number {where}, got {value!r}")
