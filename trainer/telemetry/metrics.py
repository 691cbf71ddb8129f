"""Where metrics go: a JSONL file, wandb, a loss-curve PNG and a progress bar (process 0 only)."""

from __future__ import annotations

import dataclasses
import json
import netrc
import os

from configs.base import Config
from trainer.processes import is_process_0
from trainer.storage.files import storage_errors
from trainer.storage.run_dir import RunDir


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
    import wandb  # heavy (~1 s): imported only by a run that logs to it

    run_dir.local.mkdir(parents=True, exist_ok=True)
    return wandb.init(project=project, name=name, id=run_id, resume="allow", dir=str(run_dir.local), mode=mode,
                      config=config, settings=wandb.Settings(quiet=True))  # its summary tables: in the run


class LossCurve:
    """What loss.png draws: the training loss per step and the validation loss per evaluation, at most
    MAX_POINTS points a series however long the run (when one is full, every other point goes and from then on
    only every other new one is kept): a run's memory stays flat over millions of steps."""

    MAX_POINTS = 4096

    def __init__(self, records=()):
        self.points: dict[str, list[tuple[int, float]]] = {"train": [], "val": []}
        self.stride, self.seen = {"train": 1, "val": 1}, {"train": 0, "val": 0}
        for record in records:
            self.add(record)

    def add(self, record: dict) -> None:
        if record.get("loss") is not None:
            self._add("train", record["step"], record["loss"])
        if record.get("val_loss") is not None:
            self._add("val", record["step"], record["val_loss"])

    def _add(self, series: str, step: int, value: float) -> None:
        self.seen[series] += 1
        if (self.seen[series] - 1) % self.stride[series]:
            return
        points = self.points[series]
        points.append((step, value))
        if len(points) > self.MAX_POINTS:
            points[:] = points[::2]
            self.stride[series] *= 2


class MetricsLogger:
    """Writes per-step and per-eval records. A no-op on every process but 0."""

    def __init__(self, config: Config, run_dir: RunDir, *, wandb_id: str | None, wandb_mode: str, start_step: int,
                 rollbacks: int = 0):
        self.active = is_process_0()
        self.run_dir = run_dir
        self.curve = LossCurve()
        self.wandb = None
        self.wandb_id = wandb_id
        if not self.active:
            return
        self.flush_every = config.storage.metrics_every
        history, self.file = run_dir.open_metrics(start_step, rollbacks, self.flush_every)
        self.curve = LossCurve(history)
        self.wandb = init_wandb(run_dir, wandb_mode, project=config.log.project,
                                name=config.log.run_name or run_dir.path.name, run_id=wandb_id,
                                config=dataclasses.asdict(config))
        self.wandb_id = self.wandb.id if self.wandb is not None else wandb_id

    def log(self, record: dict) -> None:
        if not self.active:
            return
        self.run_dir.check_lock()  # never write on without holding the run directory
        self.curve.add(record)
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
        history, self.file = self.run_dir.open_metrics(step, rollbacks, self.flush_every)
        self.curve = LossCurve(history)

    def sync(self) -> None:
        """Makes every record logged so far durable (on cloud storage they are appended in batches): called
        before each checkpoint save, since a resume from that checkpoint keeps the records up to its step."""
        if self.active:
            with storage_errors("write", self.run_dir / "metrics.jsonl"):
                self.file.sync()

    def plot(self) -> None:
        """runs/<name>/loss.png: training loss per step and validation loss per evaluation."""
        if not self.active or not any(self.curve.points.values()):
            return
        import matplotlib  # heavy (~0.5 s): imported only when there is a curve to draw

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        train, val = self.curve.points["train"], self.curve.points["val"]
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
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False
