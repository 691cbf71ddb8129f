"""The run directory and every file in it but `checkpoints/` (Orbax owns that one), on a local disk or on
cloud storage (`gs://bucket/path`).

    <run_dir>/
      .lock, .lock.json        one trainer at a time (holder: host, pid, start time)
      config.json              the config of the first start, never overwritten
      config_changes.jsonl     one record per resume that changed the config: {step, time, changes}
      metrics.jsonl            one JSON record per step and per evaluation, cut back to the checkpoint on resume
      loss.png                 the loss curve
      eval.json                eval.py's results, keyed by step and the settings that change the number
      logs/                    library log records, one file per process
      checkpoints/             Orbax

Paths are `etils.epath` paths, the abstraction Orbax itself uses; `gs://` goes through fsspec's `gcsfs`, which
is imported only when such a path is used. Every whole-file write is atomic: on a local disk a temporary file
renamed over the old one, on GCS a single object upload (readers see the old or the new object). Appending
differs: a local file is appended to and a torn last line is repaired on resume; GCS objects cannot be appended
to, so an appended text is uploaded as a part object and composed onto the object (`append`).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import json
import os
import socket
import sys
import time
from typing import Any, Iterator

from etils import epath

from errors import StorageError, first_line

LOCK, HOLDER = ".lock", ".lock.json"


def is_remote(path) -> bool:
    """Whether a path is on an object store (`gs://...`) rather than a local or mounted filesystem."""
    return "://" in os.fspath(path)  # epath hands `scheme://...` paths to fsspec (gcsfs for gs://)


def absolute(path) -> epath.Path:
    """A local path made absolute (Orbax wants absolute paths), a `gs://` path as it is."""
    return epath.Path(path) if is_remote(path) else epath.Path(os.path.abspath(os.path.expanduser(path)))


def _filesystem(path):
    """(fsspec filesystem, its path) of an object-store path: epath's own cached instance, so that listings
    cached by one are never stale in the other."""
    from etils.epath import backend

    fs = backend.fsspec_backend.fs(os.fspath(path))
    return fs, fs._strip_protocol(os.fspath(path))  # noqa: SLF001


def oserror_reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return first_line(e)


def _storage_exceptions() -> tuple[type[BaseException], ...]:
    """OSError, and the GCS clients' own errors (an HTTP error, no usable credentials) once they are loaded."""
    kinds: list[type[BaseException]] = [OSError]
    if "gcsfs" in sys.modules:
        from gcsfs.retry import HttpError

        kinds.append(HttpError)
    if "google.auth" in sys.modules:
        from google.auth.exceptions import GoogleAuthError

        kinds.append(GoogleAuthError)
    return tuple(kinds)


@contextlib.contextmanager
def storage_errors(what: str, path) -> Iterator[None]:
    """Turns a storage error into one line naming the path and the reason."""
    try:
        yield
    except StorageError:
        raise
    except _storage_exceptions() as e:
        reason = oserror_reason(e)
        if isinstance(e, FileNotFoundError) and is_remote(path):  # gcsfs names only the request's URL
            reason = "not found (does the bucket exist, and may these credentials use it?)"
        raise StorageError(f"cannot {what} {path}: {reason}") from None


def atomic_write(path: epath.Path, data: str | bytes) -> None:
    """Writes a whole file so that readers see the old or the new content, never a part."""
    path = epath.Path(path)

    def write(target: epath.Path) -> None:
        (target.write_bytes if isinstance(data, bytes) else target.write_text)(data)

    with storage_errors("write", path):
        if is_remote(path):  # one object upload is atomic already
            write(path)
            return
        tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
        try:
            write(tmp)
            tmp.replace(path)
        finally:
            if tmp.exists():
                tmp.unlink()


def append(path: epath.Path, data: str | bytes) -> None:
    """Appends to a file. A GCS object cannot be appended to: the data is uploaded as a part object and
    composed onto the object (GCS `compose`, atomic: readers see the object before or after the append), then
    the part is deleted. One writer at a time (the run directory's lock)."""
    path = epath.Path(path)
    data = data.encode() if isinstance(data, str) else data
    with storage_errors("write", path):
        if not is_remote(path):
            with path.open("ab") as f:
                f.write(data)
            return
        fs, key = _filesystem(path)
        if not fs.exists(key):
            fs.pipe_file(key, data)
            return
        part = f"{key}.part-{socket.gethostname()}-{os.getpid()}"
        fs.pipe_file(part, data)
        try:
            fs.merge(key, [key, part])
        finally:
            fs.rm_file(part)
            fs.invalidate_cache(key)


def move(src: epath.Path, dst: epath.Path) -> None:
    """Moves a file or a directory (on GCS: copies each object, then deletes it; epath's rename there
    insists on a destination folder, which object stores do not have)."""
    if not is_remote(src):
        dst.parent.mkdir(parents=True, exist_ok=True)
        src.rename(dst)
        return
    fs, key = _filesystem(src)
    fs.mv(key, _filesystem(dst)[1], recursive=True)
    fs.invalidate_cache()


class AppendLog:
    """An append-only text file (metrics.jsonl) opened for writing: `write`, `flush`, `sync`, `close`.

    On a local disk `flush` hands each write to the OS, so a kill loses nothing flushed. On an object store an
    append costs three requests and an object may change about once a second, so writes are buffered and
    appended by `flush` at most every `interval` seconds, by `sync` and `close` at once. The trainer syncs
    before every checkpoint save: whatever a checkpoint covers is in the object before the checkpoint can
    exist, so a resume after a kill finds every record up to its step (and cuts the rest).
    """

    def __init__(self, path: epath.Path, interval: float = 30.0):
        self.path, self.interval = path, interval
        self._file = None if is_remote(path) else path.open("a")
        self._pending: list[str] = []
        self._last = time.monotonic()

    def write(self, text: str) -> None:
        if self._file is not None:
            self._file.write(text)
        else:
            self._pending.append(text)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
        elif time.monotonic() - self._last >= self.interval:
            self.sync()

    def sync(self) -> None:
        if self._file is not None:
            self._file.flush()
            return
        if self._pending:
            append(self.path, "".join(self._pending))
            self._pending.clear()
        self._last = time.monotonic()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        else:
            self.sync()


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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, TypeError, ValueError):
        pass
    return True


class RunDir:
    """The files of one training run (process 0 writes them; other processes only read)."""

    def __init__(self, path: str | os.PathLike):
        self.path = epath.Path(path)
        self.remote = is_remote(self.path)
        self._lock = None
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

    def check_writable(self, subdir: str = "") -> None:
        """Really writes a file (mkdir succeeds on an existing read-only directory; root ignores modes; on GCS
        it succeeds in a bucket that does not exist)."""
        directory = self.path / subdir if subdir else self.path
        with storage_errors("write to", directory):
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / f".write-probe-{os.getpid()}"
            probe.write_text("")
            probe.unlink()

    # ---- one writer ------------------------------------------------------------------------------

    def lock(self) -> None:
        """Takes the run directory for this process, or raises naming the trainer that holds it."""
        self.create()
        holder = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": datetime.datetime.now().isoformat(timespec="seconds")}
        if self.remote:
            self._lock_object(holder)
        else:
            self._lock_file()
            atomic_write(self.path / HOLDER, json.dumps(holder))

    def _lock_file(self) -> None:
        """An flock (the `filelock` library): the kernel releases it when its holder dies, however it dies, so
        a crashed trainer's lock is taken over (with a warning naming it) without anyone deleting files. flock
        is reliable on local disks; on NFS (Linux 2.6.12+ emulates it with POSIX byte-range locks) it needs a
        working lock manager, and gcsfuse and other object-store mounts do not lock at all."""
        from filelock import FileLock, Timeout

        lock = FileLock(str(self.path / LOCK), timeout=0, thread_local=False)
        holder_file = self.path / HOLDER
        try:
            lock.acquire()
        except Timeout:
            raise self._in_use(holder_file) from None
        self._lock = lock
        if holder_file.exists():  # written by a trainer that never released it: it died
            warn(f"{self.path}: taking over the lock of a trainer that did not exit cleanly"
                 f" ({self._holder(holder_file)})")

    def _lock_object(self, holder: dict) -> None:
        """On GCS, which has nothing like flock, the lock is the object .lock.json itself: created only if
        absent (an upload with the precondition ifGenerationMatch=0, which GCS evaluates atomically: of two
        trainers starting at once, one gets HTTP 412) and deleted by its holder at exit. Nothing renews it, so
        the lock of a trainer that died without exiting (kill -9, a lost VM) stays: it is taken over, with a
        warning, when its holder was a process of this host that no longer runs; any other holder is refused,
        and the message names the object to delete once that trainer is known to be dead. The tests' local
        server (fake-gcs-server) honours the precondition; on real GCS exclusivity is documented, not tested.
        """
        holder_file = self.path / HOLDER
        fs, key = _filesystem(holder_file)
        for _ in range(2):
            with storage_errors("write", holder_file):
                try:
                    fs.pipe_file(key, json.dumps(holder).encode(), mode="create")
                    self._lock = holder
                    return
                except FileExistsError:
                    pass
            current = self._read_holder(holder_file)
            if current is None or not self._died_here(current):
                raise self._in_use(holder_file)
            warn(f"{self.path}: taking over the lock of a trainer that did not exit cleanly"
                 f" ({self._holder(holder_file)})")
            with storage_errors("remove the lock of a dead trainer", holder_file):
                holder_file.unlink(missing_ok=True)
        raise self._in_use(holder_file)

    @staticmethod
    def _died_here(holder: dict) -> bool:
        return holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int) \
            and not _pid_alive(holder["pid"])

    def _in_use(self, holder_file: epath.Path) -> StorageError:
        hint = f"; if it is dead, delete {holder_file}" if self.remote else ""
        return StorageError(f"{self.path} is in use by another trainer ({self._holder(holder_file)}); wait for it"
                           f" to finish or choose another --run_dir{hint}")

    @staticmethod
    def _read_holder(holder_file: epath.Path) -> dict | None:
        try:
            h = json.loads(holder_file.read_text())
            return h if isinstance(h, dict) else None
        except (OSError, ValueError):
            return None

    @classmethod
    def _holder(cls, holder_file: epath.Path) -> str:
        h = cls._read_holder(holder_file)
        try:
            return f"host {h['host']}, pid {h['pid']}, started {h['started']}"
        except (KeyError, TypeError):
            return "holder unknown"

    def unlock(self) -> None:
        if self._lock is None:
            return
        holder_file = self.path / HOLDER
        if self.remote:
            with contextlib.suppress(*_storage_exceptions()):
                if self._read_holder(holder_file) == self._lock:  # never another trainer's lock
                    holder_file.unlink()
        else:
            with contextlib.suppress(OSError):
                holder_file.unlink()
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
            append(self.path / "config_changes.jsonl", json.dumps(record) + "\n")

    def _latest_config(self, first: dict) -> dict:
        """config.json with every recorded change applied: the config of the previous start."""
        config = dict(first)
        for record in self._read_jsonl(self.path / "config_changes.jsonl", repair=False):
            config.update({k: v[1] for k, v in record.get("changes", {}).items()})
        return config

    # ---- metrics ---------------------------------------------------------------------------------

    def open_metrics(self, restored_step: int, rollbacks: int = 0) -> tuple[list[dict], AppendLog]:
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
            return history, AppendLog(path)

    def _read_jsonl(self, path: epath.Path, *, repair: bool) -> list[dict]:
        with storage_errors("read", path):
            if not path.exists():
                return []
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
                raise StorageError(f"{path}: line {i + 1} is not a JSON record; fix or remove the file") from None
        return records

    # ---- plots and evaluation results ------------------------------------------------------------

    def save_png(self, fig, name: str = "loss.png") -> None:
        import io

        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=100)
        atomic_write(self.path / name, buffer.getvalue())


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
