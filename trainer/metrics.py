"""Where metrics go: a JSONL file, wandb, a loss-curve PNG and a progress bar (process 0 only)."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import numpy as np

from configs.base import Config
from trainer.processes import is_process_0
from trainer.run_dir import RunDir, storage_errors

# Dense bf16 peak FLOP/s per chip, from the vendors' spec sheets.
PEAK_FLOPS = {
    "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5": 459e12, "TPU v5p": 459e12,
    "TPU v6 lite": 918e12, "TPU v6e": 918e12,
    "NVIDIA H100": 989e12, "NVIDIA A100": 312e12,
}


PEAK_CACHE = "~/.cache/gpt2_nnx/cpu_peak_flops.json"


def peak_flops_per_device(override: float | None) -> float:
    """The config's value, a known accelerator's spec, or (CPU) this machine's float32 matmul peak.

    The CPU peak is the best measured on this machine (CPU model, core count, JAX version), kept in PEAK_CACHE
    so that MFU compares across runs: timed afresh at each start-up on a busy machine it swung by tens of
    percent, and a first measurement made under load (a test suite on every core) was 30× too low.
    """
    if override:
        return override
    kind = jax.devices()[0].device_kind
    for name, flops in PEAK_FLOPS.items():
        if kind.startswith(name):
            return flops
    return cpu_peak_flops() / jax.local_device_count()


def cpu_peak_flops() -> float:
    from etils import epath

    from trainer.run_dir import atomic_write

    path = epath.Path(os.path.expanduser(PEAK_CACHE))
    key = f"{_cpu_model()} | {os.cpu_count()} cores | jax {jax.__version__}"
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    cache = cache if isinstance(cache, dict) else {}
    known = cache.get(key) if isinstance(cache.get(key), (int, float)) else None
    if known is not None and jax.process_index() > 0:  # process 0 logs MFU; the others need not slow it
        return float(known)
    measured = measure_matmul_peak(repeats=10 if known is None else 3)  # ~0.3 s on 2 cores once known
    if known is None or measured > known:  # a busy machine only ever measures too low: keep the best
        cache[key] = measured
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, json.dumps(cache, indent=2))
        except OSError:
            pass  # an unwritable cache only costs the measurement next time
    return float(cache[key])


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def measure_matmul_peak(n: int = 2048, dtype=np.float32, repeats: int = 5) -> float:
    """Best-of-`repeats` FLOP/s of an n×n matmul on the default backend (all its threads)."""
    import jax.numpy as jnp

    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def resolve_wandb_mode(requested: str) -> str:
    """The one decision of the wandb mode: "auto" is online with credentials (WANDB_API_KEY or a netrc
    entry), offline otherwise. A run records the mode it resolved to, and eval.py logs in that mode."""
    if requested != "auto":
        return requested
    return "online" if os.environ.get("WANDB_API_KEY") or _netrc_has_wandb() else "offline"


def init_wandb(run_dir: RunDir, mode: str, *, project: str, name: str, run_id: str | None, config=None):
    """The run's wandb run (resumed when `run_id` is given), files under run_dir/wandb (for a run on cloud
    storage: under its local directory, RunDir.local); None when disabled."""
    if mode == "disabled":
        return None
    import wandb

    run_dir.local.mkdir(parents=True, exist_ok=True)
    return wandb.init(project=project, name=name, id=run_id, resume="allow", dir=str(run_dir.local), mode=mode,
                      config=config, settings=wandb.Settings(quiet=True))  # its summary tables: in the run


class MetricsLogger:
    """Writes per-step and per-eval records. A no-op on every process but 0."""

    def __init__(self, config: Config, run_dir: RunDir, *, wandb_id: str | None, wandb_mode: str, start_step: int,
                 rollbacks: int = 0):
        self.active = is_process_0()
        self.run_dir = run_dir
        self.history: list[dict] = []
        self.wandb = None
        self.wandb_id = wandb_id
        if not self.active:
            return
        self.flush_every = config.storage.metrics_every
        self.history, self.file = run_dir.open_metrics(start_step, rollbacks, self.flush_every)
        self.wandb = init_wandb(run_dir, wandb_mode, project=config.log.project,
                                name=config.log.run_name or run_dir.path.name, run_id=wandb_id,
                                config=dataclasses.asdict(config))
        self.wandb_id = self.wandb.id if self.wandb is not None else wandb_id

    def log(self, record: dict) -> None:
        if not self.active:
            return
        self.run_dir.check_lock()  # never write on without holding the run directory
        self.history.append(record)
        with storage_errors("write", self.run_dir / "metrics.jsonl"):
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def rewind(self, step: int, rollbacks: int) -> None:
        """Drops the records after `step` from metrics.jsonl (a rollback to that step's checkpoint). wandb keeps
        what it has: its steps only increase, so it ignores the redone steps (as after a resume)."""
        if not self.active:
            return
        with storage_errors("write", self.run_dir / "metrics.jsonl"):
            self.file.close()
        self.history, self.file = self.run_dir.open_metrics(step, rollbacks, self.flush_every)

    def sync(self) -> None:
        """Makes every record logged so far durable (on cloud storage they are appended in batches): called
        before each checkpoint save, since a resume from that checkpoint keeps the records up to its step."""
        if self.active:
            with storage_errors("write", self.run_dir / "metrics.jsonl"):
                self.file.sync()

    def plot(self) -> None:
        """runs/<name>/loss.png: training loss per step and validation loss per evaluation."""
        if not self.active or not self.history:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        train = [(r["step"], r["loss"]) for r in self.history if r.get("loss") is not None]
        val = [(r["step"], r["val_loss"]) for r in self.history if "val_loss" in r]
        fig, ax = plt.subplots(figsize=(7, 4))
        if train:
            ax.plot(*zip(*train), lw=0.8, label="train")
        if val:
            ax.plot(*zip(*val), "o-", label="val")
        ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title=self.run_dir.path.name)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        try:
            self.run_dir.save_png(fig)
        finally:
            plt.close(fig)

    def close(self, *, quietly: bool = False) -> None:
        """Closes the metrics file and the wandb run; `quietly` (on the way out of a failure) reports nothing."""
        if not self.active:
            return
        try:
            with storage_errors("write", self.run_dir / "metrics.jsonl"):
                self.file.close()
        except OSError:
            if not quietly:
                raise
        if self.wandb is not None:
            self.wandb.finish(exit_code=1 if quietly else 0)
            self.wandb = None


def _netrc_has_wandb() -> bool:
    import netrc

    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False
