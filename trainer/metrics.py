"""Where metrics go: a JSONL file, wandb, a loss-curve PNG and a progress bar (process 0 only)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import jax
import numpy as np

from configs.base import Config

# Dense bf16 peak FLOP/s per chip, from the vendors' spec sheets.
PEAK_FLOPS = {
    "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5": 459e12, "TPU v5p": 459e12,
    "TPU v6 lite": 918e12, "TPU v6e": 918e12,
    "NVIDIA H100": 989e12, "NVIDIA A100": 312e12,
}


def peak_flops_per_device(override: float | None) -> float:
    """The config's value, a known accelerator's spec, or (CPU) a float32 matmul measured here."""
    if override:
        return override
    kind = jax.devices()[0].device_kind
    for name, flops in PEAK_FLOPS.items():
        if kind.startswith(name):
            return flops
    return measure_matmul_peak() / jax.local_device_count()


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


class MetricsLogger:
    """Writes per-step and per-eval records. A no-op on every process but 0."""

    def __init__(self, config: Config, run_dir: Path, *, wandb_id: str | None, start_step: int):
        self.active = jax.process_index() == 0
        self.run_dir = run_dir
        self.history: list[dict] = []
        self.wandb = None
        self.wandb_id = wandb_id
        if not self.active:
            return
        path = run_dir / "metrics.jsonl"
        if path.exists():  # resuming: keep records up to the restored step, drop the lost tail
            self.history = [r for r in map(json.loads, path.read_text().splitlines()) if r["step"] <= start_step]
            path.write_text("".join(json.dumps(r) + "\n" for r in self.history))
        self.file = path.open("a")
        self._init_wandb(config)

    def _init_wandb(self, config: Config) -> None:
        mode = config.log.wandb
        if mode == "disabled":
            return
        import wandb

        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") or _netrc_has_wandb() else "offline"
        self.wandb = wandb.init(
            project=config.log.project, name=config.log.run_name or self.run_dir.name,
            id=self.wandb_id, resume="allow", dir=str(self.run_dir), mode=mode,
            config=dataclasses.asdict(config),
        )
        self.wandb_id = self.wandb.id

    def log(self, record: dict) -> None:
        if not self.active:
            return
        self.history.append(record)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def plot(self) -> None:
        """runs/<name>/loss.png: training loss per step and validation loss per evaluation."""
        if not self.active or not self.history:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        train = [(r["step"], r["loss"]) for r in self.history if "loss" in r]
        val = [(r["step"], r["val_loss"]) for r in self.history if "val_loss" in r]
        fig, ax = plt.subplots(figsize=(7, 4))
        if train:
            ax.plot(*zip(*train), lw=0.8, label="train")
        if val:
            ax.plot(*zip(*val), "o-", label="val")
        ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title=self.run_dir.name)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        tmp = self.run_dir / ".loss.png.tmp"
        fig.savefig(tmp, format="png", dpi=100)
        plt.close(fig)
        os.replace(tmp, self.run_dir / "loss.png")

    def close(self) -> None:
        if not self.active:
            return
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def _netrc_has_wandb() -> bool:
    import netrc

    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False
