"""The run directory and every file in it but `checkpoints/` (Orbax owns that one), on a local disk or on
cloud storage (`gs://bucket/path`).

    <run_dir>/
      .lock, .lock.json        one trainer at a time (trainer/storage/lock.py)
      config.json              the config of the first start, never overwritten
      config_changes.jsonl     one record per resume that changed the config: {step, time, changes}
      metrics.jsonl            one JSON record per step and per evaluation, cut back to the checkpoint on resume
      events.jsonl             every attempt's timeline, never cut back (trainer/telemetry/timeline.py)
      loss.png                 the loss curve
      eval.json                eval.py's results, keyed by step and the settings that change the number
      logs/                    library log records, one file per process
      checkpoints/             Orbax (trainer/storage/checkpoints.py)

Writes are atomic, appends buffered on cloud storage (trainer/storage/files.py); a last line torn by a kill is
repaired on resume. No JAX.
"""

from __future__ import annotations

import datetime
import importlib.util
import io
import json
import os
from typing import Any

from etils import epath

from configs.base import StorageConfig
from errors import StorageError, warn
from trainer.storage.files import AppendLog, append, atomic_write, is_remote, storage_errors
from trainer.storage.lock import RunDirLock
from trainer.storage.retries import retry_storage_for


TORN = "dropped a torn last line (a kill or a full disk during its write)"

class RunDir:
    """The files of one training run (process 0 writes them; other processes only read)."""

    def __init__(self, path: str | os.PathLike):
        self.path = epath.Path(path)
        self.remote = is_remote(self.path)
        self._lock = RunDirLock(self.path)
        if self.remote and importlib.util.find_spec("gcsfs") is None:
            raise StorageError(f"{path}: a run directory on cloud storage needs the gcs extra"
                              " (pip install -e '.[gcs]')")

    def __truediv__(self, name: str) -> epath.Path:
        return self.path / name

    @property
    def local(self) -> epath.Path:
        """Where files that only a local filesystem can hold go (wandb's): the run directory itself, or for a
        run on cloud storage a directory of the same name under ~/.cache/gpt2_nnx/runs/."""
        if not self.remote:
            return self.path
        return epath.Path(os.path.expanduser("~/.cache/gpt2_nnx/runs")) / os.fspath(self.path).split("://", 1)[1]

    def create(self) -> None:
        with storage_errors("create the run directory", self.path):
            self.path.mkdir(parents=True, exist_ok=True)
        self.check_writable()

    def check_writable(self, subdir: str = "", *, for_file: str | None = None) -> None:
        """Really writes a file (mkdir succeeds on an existing read-only directory; root ignores modes; on GCS
        it succeeds in a bucket that does not exist). A failure names the directory, or `for_file` in it (the
        file the caller is about to write)."""
        directory = self.path / subdir if subdir else self.path
        with storage_errors(*(("write", directory / for_file) if for_file else ("write to", directory))):
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / f".write-probe-{os.getpid()}"
            probe.write_text("")
            probe.unlink()

    # ---- one writer (trainer/storage/lock.py) ----------------------------------------------------

    def lock(self, refresh_every: float = 60.0) -> None:
        """Takes the run directory for this process, or raises naming the trainer that holds it."""
        self.create()
        self._lock.acquire(refresh_every)

    def check_lock(self) -> None:
        """Raises if the lock's refresh failed: the run must not go on writing without holding it."""
        self._lock.check()

    def unlock(self) -> None:
        self._lock.release()

    # ---- config ----------------------------------------------------------------------------------

    def record_config(self, config: dict, step: int) -> None:
        """Saves the first start's config as config.json; later starts append what they changed to
        config_changes.jsonl (config.json is never overwritten)."""
        path = self.path / "config.json"
        if not path.exists():
            atomic_write(path, json.dumps(config, indent=2))
            return
        try:
            first = flat(json.loads(path.read_text()))
        except (OSError, ValueError):
            first = {}
        previous = self._latest_config(first)
        changes = {k: (previous.get(k), v) for k, v in flat(config).items() if previous.get(k) != v}
        if changes:
            record = {"step": step, "time": datetime.datetime.now().isoformat(timespec="seconds"),
                      "changes": {k: list(v) for k, v in changes.items()}}
            append(self.path / "config_changes.jsonl", json.dumps(record) + "\n")

    def _latest_config(self, first: dict) -> dict:
        """config.json with every recorded change applied: the config of the previous start."""
        config = dict(first)
        for record in self._read_jsonl(self.path / "config_changes.jsonl", repair=False):
            config.update({k: v[1] for k, v in record.get("changes", {}).items()})
        return config

    # ---- metrics ---------------------------------------------------------------------------------

    def open_metrics(self, restored_step: int, rollbacks: int = 0,
                     flush_every: float = 30.0) -> tuple[list[dict], AppendLog]:
        """(records up to the restored step, metrics.jsonl opened for appending).

        A resumed run redoes the steps after its checkpoint, so their records are dropped, and so is everything
        from a rollback record its checkpoint had not seen on (`rollbacks`: the rollbacks the checkpoint's
        run had taken); a last line torn by a kill or a full disk is dropped with a warning, not fatal.
        """
        path = self.path / "metrics.jsonl"
        records = self._read_jsonl(path, repair=True)
        unseen = [i for i, r in enumerate(records) if r.get("rollback", 0) > rollbacks]
        history = [r for r in records[: unseen[0] if unseen else None] if r.get("step", 0) <= restored_step]
        if path.exists():
            atomic_write(path, "".join(json.dumps(r) + "\n" for r in history))
        with storage_errors("write", path):
            return history, AppendLog(path, flush_every)

    def read_events(self, *, say_torn: bool = True) -> list[dict]:
        """events.jsonl's records (trainer/telemetry/timeline.py): every attempt's, never cut back by a resume. A torn
        last line is left out (and said, unless `say_torn` is False)."""
        return self.load_events(say_torn=say_torn)[0]

    def load_events(self, *, say_torn: bool = True) -> tuple[list[dict], bool]:
        """(events.jsonl's records, whether a torn last line was left out)."""
        return self._load_jsonl(self.path / "events.jsonl", repair=True, say_torn=say_torn)

    def open_events(self, flush_every: float = 30.0, *, loaded: tuple[list[dict], bool] | None = None) -> AppendLog:
        """events.jsonl opened for appending; a torn last line (a kill during its write) is dropped from the
        file first, as from metrics.jsonl, and said. `loaded`: the file as `load_events(say_torn=False)` read
        it at start-up (the lock held since: nothing else writes it), so that a start reads it once."""
        path = self.path / "events.jsonl"
        if loaded is None:
            loaded = self.load_events(say_torn=False)
        records, torn = loaded
        if torn:
            warn(f"{path}: {TORN}")
            atomic_write(path, "".join(json.dumps(r) + "\n" for r in records))
        with storage_errors("write", path):
            return AppendLog(path, flush_every)

    def _read_jsonl(self, path: epath.Path, *, repair: bool) -> list[dict]:
        return self._load_jsonl(path, repair=repair)[0]

    @staticmethod
    def _load_jsonl(path: epath.Path, *, repair: bool, say_torn: bool = True) -> tuple[list[dict], bool]:
        """(the file's records, whether a torn last line was dropped: only with `repair`; said unless
        `say_torn` is False)."""
        with storage_errors("read", path):
            if not path.exists():
                return [], False
            lines = path.read_text().splitlines()
        records = []
        for i, line in enumerate(lines):
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError("not an object")
                records.append(record)
            except ValueError:
                if i == len(lines) - 1 and repair:
                    if say_torn:
                        warn(f"{path}: {TORN}")
                    return records, True
                raise StorageError(f"{path}: line {i + 1} is not a JSON record; fix or remove the file") from None
        return records, False

    # ---- plots and evaluation results ------------------------------------------------------------

    def save_png(self, fig, name: str = "loss.png") -> None:
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=100)
        atomic_write(self.path / name, buffer.getvalue())


def open_run_dir(path: str | os.PathLike, storage: StorageConfig) -> RunDir:
    """The run directory at `path`; on cloud storage every request of this process from now on retries a
    faltering store for `storage.retry_seconds` (train.py and eval.py alike)."""
    run_dir = RunDir(path)
    if run_dir.remote:
        retry_storage_for(storage.retry_seconds, storage.request_timeout)
    return run_dir


def flat(d: dict, prefix: str = "") -> dict[str, Any]:
    """{"train": {"steps": 60}} -> {"train.steps": 60}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out




def eval_record(settings: dict, **figures) -> dict:
    """An eval.json record: its key (every setting that changes the figures, in order), the settings, the
    figures."""
    return {"key": ",".join(f"{k}={v}" for k, v in settings.items()), **settings, **figures}


def merge_eval_results(path, records: list[dict]) -> None:
    """Adds evaluation records to a results file (eval.json), replacing only records with the same key.

    The key is the checkpoint step (or the HF model) with every setting that changes the number: dataset,
    seq_len, batch_size and number of batches, so `--batches 20` never replaces a whole-split result.
    """
    path = epath.Path(path)
    existing = []
    with storage_errors("read", path):
        found = path.exists()
    if found:
        try:
            existing = json.loads(path.read_text())["results"]
        except (OSError, ValueError, KeyError, TypeError):
            existing = None
        if not (isinstance(existing, list) and all(isinstance(r, dict) and "key" in r for r in existing)):
            raise StorageError(f"{path}: not an eval.json written by eval.py; move it away or pass another --out")
    keys = {r["key"] for r in records}
    merged = [r for r in existing if r["key"] not in keys] + records
    with storage_errors("create", path.parent):
        path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps({"results": merged}, indent=2))

