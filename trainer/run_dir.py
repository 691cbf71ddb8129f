"""The run directory and every file in it but `checkpoints/` (Orbax owns that one).

    <run_dir>/
      .lock, .lock.json        one trainer at a time (holder: host, pid, start time)
      config.json              the config of the first start, never overwritten
      config_changes.jsonl     one record per resume that changed the config: {step, time, changes}
      metrics.jsonl            one JSON record per step and per evaluation, cut back to the checkpoint on resume
      loss.png                 the loss curve
      eval.json                eval.py's results, keyed by step and the settings that change the number
      checkpoints/             Orbax

Every whole-file write is atomic (a temporary file renamed over the old one), so a kill or a full disk never
leaves a half-written file; `metrics.jsonl` is appended to, and a torn last line is repaired on resume.
Paths are `etils.epath` paths, the abstraction Orbax itself uses.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
from typing import Any, Iterator

from etils import epath

from configs.errors import RunDirError

LOCK, HOLDER = ".lock", ".lock.json"


def oserror_reason(e: OSError) -> str:
    return e.strerror or str(e) or type(e).__name__


@contextlib.contextmanager
def storage_errors(what: str, path) -> Iterator[None]:
    """Turns an OSError into one line naming the path and the OS's reason."""
    try:
        yield
    except OSError as e:
        if isinstance(e, RunDirError):
            raise
        raise RunDirError(f"cannot {what} {path}: {oserror_reason(e)}") from None


def atomic_write(path: epath.Path, data: str | bytes) -> None:
    """Writes a whole file so that readers see the old or the new content, never a part."""
    path = epath.Path(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    with storage_errors("write", path):
        try:
            (tmp.write_bytes if isinstance(data, bytes) else tmp.write_text)(data)
            tmp.replace(path)
        finally:
            if tmp.exists():
                tmp.unlink()


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def flat(d: dict, prefix: str = "") -> dict[str, Any]:
    """{"train": {"steps": 60}} -> {"train.steps": 60}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class RunDir:
    """The files of one training run (process 0 writes them; other processes only read)."""

    def __init__(self, path: str | os.PathLike):
        self.path = epath.Path(path)
        self._lock = None

    def __truediv__(self, name: str) -> epath.Path:
        return self.path / name

    def create(self) -> None:
        with storage_errors("create the run directory", self.path):
            self.path.mkdir(parents=True, exist_ok=True)
        self.check_writable()

    def check_writable(self, subdir: str = "") -> None:
        """Really writes a file (mkdir succeeds on an existing read-only directory; root ignores modes)."""
        directory = self.path / subdir if subdir else self.path
        with storage_errors("write to", directory):
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / f".write-probe-{os.getpid()}"
            probe.write_text("")
            probe.unlink()

    # ---- one writer ------------------------------------------------------------------------------

    def lock(self) -> None:
        """Takes the run directory for this process, or raises naming the trainer that holds it.

        An flock (the `filelock` library): the kernel releases it when its holder dies, however it dies, so a
        crashed trainer's lock is taken over (with a warning naming it) without anyone deleting files. flock is
        reliable on local disks; on NFS (Linux 2.6.12+ emulates it with POSIX byte-range locks) it needs a
        working lock manager, and gcsfuse and other object-store mounts do not lock at all.
        """
        from filelock import FileLock, Timeout

        self.create()
        lock = FileLock(str(self.path / LOCK), timeout=0, thread_local=False)
        holder_file = self.path / HOLDER
        try:
            lock.acquire()
        except Timeout:
            raise RunDirError(f"{self.path} is in use by another trainer ({self._holder(holder_file)}); wait for it"
                              " to finish or choose another --run_dir") from None
        self._lock = lock
        if holder_file.exists():  # written by a trainer that never released it: it died
            warn(f"{self.path}: taking over the lock of a trainer that did not exit cleanly"
                 f" ({self._holder(holder_file)})")
        holder = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": datetime.datetime.now().isoformat(timespec="seconds")}
        atomic_write(holder_file, json.dumps(holder))

    @staticmethod
    def _holder(holder_file: epath.Path) -> str:
        try:
            h = json.loads(holder_file.read_text())
            return f"host {h['host']}, pid {h['pid']}, started {h['started']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "holder unknown"

    def unlock(self) -> None:
        if self._lock is not None:
            with contextlib.suppress(OSError):
                (self.path / HOLDER).unlink()
            self._lock.release()
            self._lock = None

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
            self._append(self.path / "config_changes.jsonl", json.dumps(record) + "\n")

    def _latest_config(self, first: dict) -> dict:
        """config.json with every recorded change applied: the config of the previous start."""
        config = dict(first)
        for record in self._read_jsonl(self.path / "config_changes.jsonl", repair=False):
            config.update({k: v[1] for k, v in record.get("changes", {}).items()})
        return config

    # ---- metrics ---------------------------------------------------------------------------------

    def open_metrics(self, restored_step: int) -> tuple[list[dict], Any]:
        """(records up to the restored step, the file opened for appending).

        A resumed run redoes the steps after its checkpoint, so their records are dropped; a last line torn by
        a kill or a full disk is dropped with a warning, not fatal.
        """
        path = self.path / "metrics.jsonl"
        history = [r for r in self._read_jsonl(path, repair=True) if r.get("step", 0) <= restored_step]
        if path.exists():
            atomic_write(path, "".join(json.dumps(r) + "\n" for r in history))
        with storage_errors("write", path):
            return history, path.open("a")

    def _read_jsonl(self, path: epath.Path, *, repair: bool) -> list[dict]:
        if not path.exists():
            return []
        with storage_errors("read", path):
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
                    warn(f"{path}: dropped a torn last line (a kill or a full disk during its write)")
                    continue
                raise RunDirError(f"{path}: line {i + 1} is not a JSON record; fix or remove the file") from None
        return records

    def _append(self, path: epath.Path, text: str) -> None:
        with storage_errors("write", path):
            with path.open("a") as f:
                f.write(text)

    # ---- plots and evaluation results ------------------------------------------------------------

    def save_png(self, fig, name: str = "loss.png") -> None:
        import io

        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=100)
        atomic_write(self.path / name, buffer.getvalue())


def merge_eval_results(path, records: list[dict]) -> None:
    """Adds evaluation records to a results file (eval.json), replacing only records with the same key.

    The key is the checkpoint step (or the HF model) with every setting that changes the number: dataset,
    seq_len, batch_size and number of batches, so `--batches 20` never replaces a whole-split result.
    """
    path = epath.Path(path)
    existing = []
    if path.exists():
        try:
            existing = json.loads(path.read_text())["results"]
        except (OSError, ValueError, KeyError, TypeError):
            existing = None
        if not (isinstance(existing, list) and all(isinstance(r, dict) and "key" in r for r in existing)):
            raise RunDirError(f"{path}: not an eval.json written by eval.py; move it away or pass another --out")
    keys = {r["key"] for r in records}
    merged = [r for r in existing if r["key"] not in keys] + records
    with storage_errors("create", path.parent):
        path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps({"results": merged}, indent=2))
