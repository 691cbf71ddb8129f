"""The training application's configuration: one frozen dataclass per concern, composed into `Config`.

Each field states its meaning and its bound once, in its `Field` (fields.py checks them all); rules
between fields are the class's `cross_check()`. Presets live beside this file (`configs/shakespeare_cpu.py`, ...);
any field can be overridden on the command line: `python train.py --config gpt2_124m --model.n_layer=6`.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

from fields import Checked, Field
from errors import ConfigError
from gpt2.config import GPT2Config
from gpt2.sharding import RULES
from optim import GuardConfig, OptimizerConfig, ScheduleConfig
from optim.adamw import AdamWConfig
from optim.schedules import CosineSchedule


@dataclasses.dataclass(frozen=True)
class DataConfig(Checked, section="data"):
    """Where tokens come from."""

    dataset: Annotated[str, Field(
        '"shakespeare" (the embedded corpus, tokenized into data.cache_dir on first use) or the directory of a'
        " corpus prepared with `python -m data.prepare`")] = "shakespeare"
    cache_dir: Annotated[str, Field("where the embedded corpus is tokenized to")] = "~/.cache/gpt2_nnx/shakespeare"
    num_workers: Annotated[int, Field("Grain worker processes per host; 0 reads in the training process", ge=0)] = 0
    prefetch: Annotated[int, Field("batches read ahead", ge=0)] = 2
    seed: Annotated[int, Field("data order seed (independent of the model seed)", ge=0)] = 1234


@dataclasses.dataclass(frozen=True)
class MeshConfig(Checked, section="mesh"):
    """Device mesh sizes (-1: all remaining devices) and the logical-axis rules preset. The product of the three
    sizes must be the number of devices."""

    data: Annotated[int, Field("pure data-parallel size", ge=1, special={-1: "the devices the other axes leave"})] = -1
    fsdp: Annotated[int, Field(
        "data-parallel size with parameters, gradients and optimizer state sharded over it (ZeRO-3)", ge=1,
        special={-1: "the devices the other axes leave"})] = 1
    tensor: Annotated[int, Field(
        "tensor-parallel size (heads, MLP and vocabulary split over it)", ge=1,
        special={-1: "the devices the other axes leave"})] = 1
    rules: Annotated[str, Field("the logical-axis rules of gpt2/sharding.py", one_of=RULES)] = "fsdp"
    num_slices: Annotated[int, Field(
        "TPU slices the run spans, joined by the data-center network (DCN). The data axis spans them (slices ×"
        " the data parallelism inside one); fsdp and tensor stay inside a slice, so mesh.data must be a multiple"
        " of it. Devices are grouped by their slice_index (on CPUs by process, consecutive processes forming a"
        " slice)", ge=1)] = 1

    def cross_check(self) -> None:
        if self.data != -1 and self.data % self.num_slices:
            raise ConfigError(f"mesh.data={self.data} must be a multiple of mesh.num_slices={self.num_slices}: data"
                              " parallelism spans the slices (fsdp and tensor stay inside one)")


@dataclasses.dataclass(frozen=True)
class TrainConfig(Checked, section="train"):
    """The training loop."""

    steps: Annotated[int, Field("optimizer steps in total; a run never takes a step past it", ge=1)] = 1000
    batch_size: Annotated[int, Field("global batch: sequences per optimizer step, over all processes", ge=1)] = 16
    seq_len: Annotated[int, Field("tokens per sequence (at most model.block_size)", ge=1)] = 256
    grad_accum: Annotated[int, Field(
        "micro-batches per optimizer step (batch_size is split into this many)", ge=1)] = 1
    steps_per_call: Annotated[int, Field(
        "K optimizer steps run by one jitted call (a lax.scan); logging stays per step. A call stops early at an"
        " evaluation, a checkpoint or the last step, so none of them moves with K", ge=1)] = 10
    seed: Annotated[int, Field("model initialization and dropout seed", ge=0)] = 0
    eval_every: Annotated[int, Field(
        "evaluate the validation loss every this many steps (0: only at the last step, where an evaluation"
        " always runs)", ge=0)] = 100
    eval_batches: Annotated[int, Field("validation batches per evaluation", ge=1)] = 10
    sample_prompt: Annotated[str | None, Field(
        "text sampled from at the end of training (it must fit model.block_size); None: \"ROMEO:\" on the embedded"
        " Shakespeare corpus, an unconditional sample (from <|endoftext|>) on any other")] = None
    sample_tokens: Annotated[int, Field(
        "tokens generated for that sample (0: no sample); past model.block_size each is sampled from the last"
        " block_size tokens, as nanoGPT does", ge=0)] = 100
    peak_flops: Annotated[float | None, Field(
        "per-device peak FLOP/s for MFU (default: looked up from the device kind)", gt=0)] = None
    stop_after: Annotated[int | None, Field(
        "end this invocation (with a checkpoint) at this step, without changing the schedule; a later start"
        " resumes towards train.steps (time-boxed jobs)", ge=1)] = None
    async_calls: Annotated[bool, Field(
        "dispatch call n+1 before reading call n's metrics, so the devices never wait for the host's logging,"
        " data reading and host-to-device copy (metrics are logged one call late; evaluations, checkpoints, the"
        " stop step and preemption still wait for their call). False: wait after every call")] = True
    reschedule: Annotated[bool, Field(
        "allow a resumed run to change its learning rates: any optim.* or schedule.* field, or train.steps where"
        " the schedule's length follows it (cosine without schedule.decay_steps, wsd). The rates then jump to the"
        " new values at the resumed step. Without it such a resume is refused")] = False
    compile_cache: Annotated[str, Field(
        "JAX's persistent compilation cache, so that a restart, or a new run of programs compiled before, loads"
        ' them instead of compiling them again: "auto" (a local run directory: ~/.cache/gpt2_nnx/compile_cache,'
        " shared by this user's runs; gs://: <run_dir>/compile_cache, shared by every host of the job), a"
        ' directory (local or gs://; safe to share between jobs), or "off". A JAX_COMPILATION_CACHE_DIR set in the'
        ' environment takes precedence over "auto"')] = "auto"
    compile_cache_gb: Annotated[float, Field(
        "the cache's size bound; the least recently used programs are evicted past it", gt=0)] = 4.0
    eval_tasks: Annotated[str | None, Field(
        "lm-evaluation-harness tasks (comma-separated) run at every evaluation, with the validation loss; needs"
        " the eval extra. Every task is loaded at start-up, so a task that cannot be (a hub dataset with no"
        " network) stops the run before training")] = None
    eval_limit: Annotated[int | None, Field("documents per task at each evaluation (None: all)", ge=1)] = None
    include_path: Annotated[str | None, Field(
        "a directory of lm-eval task YAMLs (local tasks need no network)")] = None

    def cross_check(self) -> None:
        if self.batch_size % self.grad_accum:
            raise ConfigError(f"train.grad_accum={self.grad_accum} must divide train.batch_size={self.batch_size}")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Checked, section="checkpoint"):
    """Orbax checkpointing."""

    every: Annotated[int, Field("save every this many steps (a save also happens at the end)", ge=1)] = 500
    keep: Annotated[int, Field("most recent checkpoints kept", ge=1)] = 3
    keep_every: Annotated[int | None, Field(
        "also keep every checkpoint whose step is a multiple of this", ge=1)] = None
    async_save: Annotated[bool, Field("write in the background while training continues")] = True


@dataclasses.dataclass(frozen=True)
class LogConfig(Checked, section="log"):
    """Metrics."""

    wandb: Annotated[Literal["auto", "online", "offline", "disabled"], Field(
        '"auto": online with credentials, else offline')] = "auto"
    project: Annotated[str, Field("wandb project")] = "gpt2-nnx"
    run_name: Annotated[str | None, Field("wandb run name (default: the run directory's name)")] = None
    progress: Annotated[bool, Field("show a progress bar")] = True
    print_config: Annotated[bool, Field(
        "also print the full effective config at start-up (it is always in config.json)")] = False
    param_report: Annotated[bool, Field(
        "also print every parameter's shape, logical axes, partition and bytes per device at start-up (the"
        " summary gives the totals)")] = False
    profile_start: Annotated[int | None, Field(
        "capture a jax.profiler trace from the call that reaches this step (None: no trace) into"
        " <run_dir>/profile on process 0; open it with TensorBoard's profile plugin / XProf, or Perfetto",
        ge=1)] = None
    profile_steps: Annotated[int, Field(
        "steps the trace covers (whole calls: rounded up to the calls that contain them)", ge=1)] = 5
    show_sharding: Annotated[str | None, Field(
        "also draw this ≤2-D parameter's layout over the devices at start-up"
        ' (jax.debug.visualize_array_sharding), e.g. "wte.embedding"')] = None


@dataclasses.dataclass(frozen=True)
class DistributedConfig(Checked, section="distributed"):
    """Multi-process (multi-host) setup. All None: JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID
    if set, else JAX's own cluster detection (Cloud TPU VMs and GKE, SLURM, Open MPI, Kubernetes), else one
    process. Explicit values override the detection."""

    coordinator_address: Annotated[str | None, Field('"host:port" of process 0')] = None
    num_processes: Annotated[int | None, Field("processes in the job", ge=1)] = None
    process_id: Annotated[int | None, Field("this process's index", ge=0)] = None
    heartbeat_timeout_seconds: Annotated[int, Field(
        "a process missing this long is declared dead and the others exit with an error instead of waiting"
        " forever", ge=1)] = 100
    initialization_timeout: Annotated[int, Field(
        "seconds to wait for every process to join: then every process that can ends in one line naming those that"
        " did not check in (trainer/rollcall.py)", ge=1)] = 300
    startup_timeout_seconds: Annotated[float, Field(
        "seconds from the job's forming by which every process must have finished its first train call (restore,"
        " build, compile: minutes on a pod; several processes only); 0: unbounded. A process late to a start-up"
        " point (an agreement, the first call) is named in one line on every process; one stuck inside its first"
        " call ends itself 30 s after", ge=0)] = 1800.0
    stall_timeout_seconds: Annotated[float | None, Field(
        "end the job when no train call has finished for this long (one process too): each process that can"
        " still act writes its threads' stacks to <run_dir>/logs/stacks.<i>.txt and exits 2 with one line. None:"
        " max(stall_floor_seconds, 20 × the median call time), counted from the first call's end (its"
        " compilation is not a stall); 0: no watchdog. An evaluation or a checkpoint must finish within it too;"
        " train.eval_tasks' lm-eval runs pause it", ge=0)] = None
    stall_floor_seconds: Annotated[float, Field(
        "the automatic stall timeout's floor; on a gs:// run directory at least storage.retry_seconds +"
        " storage.request_timeout, so that the storage layer reports its own failures", gt=0)] = 300.0

    def cross_check(self) -> None:
        n, i = self.num_processes, self.process_id
        if n is not None and i is not None and i >= n:
            raise ConfigError(f"distributed.process_id={i} must be < distributed.num_processes={n}")


@dataclasses.dataclass(frozen=True)
class StorageConfig(Checked, section="storage"):
    """Cloud storage (a gs:// run directory), which may falter for minutes on a pod."""

    retry_seconds: Annotated[float, Field(
        "how long a request (a checkpoint save, a metrics append, the lock's refresh) retries a transient failure"
        " (HTTP 429/5xx, a refused or reset connection, no answer) with backoff before the run stops in one line."
        " The newest finished checkpoint stays the newest", gt=0)] = 600.0
    request_timeout: Annotated[float, Field(
        "seconds a request to the run directory's objects (metadata, metrics, the lock, the checkpoint arrays)"
        " may wait for the server's next bytes before it is failed and retried: a connection that hangs would"
        " otherwise hang the whole job. For the arrays it sets TensorStore's"
        " TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS (replacing the environment's)", gt=0)] = 60.0
    metrics_every: Annotated[float, Field(
        "seconds between appends of buffered metrics.jsonl records to their object (each checkpoint save appends"
        " first)", gt=0)] = 30.0
    lock_refresh_seconds: Annotated[float, Field(
        "seconds between refreshes of the run directory's lock object; a lock not refreshed for 10 periods plus"
        " retry_seconds is taken over as a dead trainer's", gt=0)] = 60.0


@dataclasses.dataclass(frozen=True)
class Config(Checked):
    """Everything a training run needs."""

    run_dir: Annotated[str, Field(
        "the run directory: checkpoints, metrics.jsonl, loss.png, config.json, logs and wandb files; a start on a"
        " directory holding checkpoints resumes from them. A local path or gs://bucket/path (the gcs"
        " extra)")] = "runs/default"
    init_from: Annotated[str | None, Field(
        "start a new run from GPT-2 weights: a Hugging Face directory (config.json + safetensors, e.g. from"
        " `python -m tools.export_hf`) or hub:NAME (e.g. hub:openai-community/gpt2). Its config.json sets the"
        " model's architecture (a contradicting --model.* flag is an error); the optimizer starts fresh. A run"
        " directory holding checkpoints resumes from them, not from these weights")] = None
    model: GPT2Config = GPT2Config.tiny()
    data: DataConfig = DataConfig()
    optim: OptimizerConfig = AdamWConfig()  # --optim.name picks the variant (optim/): adamw, muon
    schedule: ScheduleConfig = CosineSchedule()  # --schedule.name (optim/schedules.py): cosine, wsd
    train: TrainConfig = TrainConfig()
    mesh: MeshConfig = MeshConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    guard: GuardConfig = GuardConfig()
    log: LogConfig = LogConfig()
    distributed: DistributedConfig = DistributedConfig()
    storage: StorageConfig = StorageConfig()

    def cross_check(self) -> None:
        if self.model.param_dtype == "float16":
            # float16's smallest number is ~6e-8: Adam's second moment (gradients² ~1e-10) and eps (1e-8) become 0
            raise ConfigError("model.param_dtype=float16 cannot be trained: the optimizer state is kept in it and "
                              "underflows (the loss turns NaN within steps); use float32 or bfloat16, and "
                              "model.dtype for the compute")
        if self.init_from is not None and self.model.parametrization == "mup":
            raise ConfigError(f"--init_from {self.init_from}: Hugging Face GPT-2 weights are in the standard"
                              " parametrization; model.parametrization=mup would read them with μP's multipliers"
                              " (drop one of the two)")
        if self.train.seq_len > self.model.block_size:
            raise ConfigError(f"train.seq_len={self.train.seq_len} exceeds model.block_size={self.model.block_size}:"
                              f" lower --train.seq_len, or raise --model.block_size (a fresh run only)")
