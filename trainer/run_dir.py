"""The run directory and every file in it but `checkpoints/` (Orbax owns that one), on a local disk or on
cloud storage (`gs://bucket/path`).

    <run_dir>/
      .lock, .lock.json        one trainer at a time (holder: host, pid, start time; on GCS a lease: token,
                               last refresh)
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
import functools
import importlib.util
import json
import math
import os
import random
import socket
import sys
import threading
import time
import uuid
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


def storage_exceptions() -> tuple[type[BaseException], ...]:
    """OSError, and the GCS clients' own errors (an HTTP error, a dropped connection, no usable credentials)
    once they are loaded."""
    kinds: list[type[BaseException]] = [OSError]
    if "aiohttp" in sys.modules:  # gcsfs's transport: a dropped connection is not an OSError there
        from aiohttp import ClientError

        kinds.append(ClientError)
    if "gcsfs" in sys.modules:
        from gcsfs.retry import HttpError

        kinds.append(HttpError)
    if "google.auth" in sys.modules:
        from google.auth.exceptions import GoogleAuthError

        kinds.append(GoogleAuthError)
    return tuple(kinds)


# ---- cloud storage that falters --------------------------------------------------------------------

_retry = {"budget": 600.0, "since": None}  # the retry budget (seconds); when the current outage began


def retry_storage_for(budget: float, request_timeout: float) -> None:
    """Every cloud-storage request of this process (the trainer's files, the lock, Orbax's metadata through
    gcsfs; its arrays through TensorStore) retries transient failures (HTTP 429/5xx, a refused or reset
    connection, a timeout) with exponential backoff for up to `budget` seconds before it fails. An outage is
    reported once, when it starts, and once when it ends.

    gcsfs retries a request 6 times (~30 s) with no setting to change it, so its request method's own retry
    decorator is replaced here by one with a budget in seconds (the same retriable errors: gcsfs's
    `is_retriable`); TensorStore takes its retry limits from its context, which Orbax builds from a
    module-level default, and its timeout from the environment. A request that receives no byte for
    `request_timeout` seconds fails and is retried in both.
    """
    _retry["budget"] = float(budget)
    _tensorstore_limits(budget, request_timeout)
    if importlib.util.find_spec("gcsfs") is None:
        return
    import aiohttp
    import fsspec
    import gcsfs

    # gcsfs waits forever for an answer by default: a stalled connection would hang every process of the job.
    # The filesystems made from now on (fsspec's defaults for "gcs") fail such a request, and it is retried.
    fsspec.config.conf.setdefault("gcs", {})["requests_timeout"] = aiohttp.ClientTimeout(
        sock_connect=request_timeout, sock_read=request_timeout)

    request = gcsfs.GCSFileSystem._request
    if not getattr(request, "budgeted", False):
        gcsfs.GCSFileSystem._request = _budgeted(getattr(request, "__wrapped__", request))


def _budgeted(request):
    from gcsfs.retry import is_retriable

    @functools.wraps(request)
    async def retried(self, *args, _took_effect=None, **kwargs):
        """`_took_effect`: for a request that must not be made twice (an append's compose), an async check,
        asked before each retry, whether a failed attempt (its answer lost) was carried out after all."""
        import asyncio

        delay, started = 1.0, time.monotonic()
        while True:
            try:
                result = await request(self, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - what may be retried is gcsfs's own judgement
                if not (is_retriable(e) and time.monotonic() - started < _retry["budget"]):
                    raise
                _outage_began(e)
                await asyncio.sleep(min(delay, max(0.0, _retry["budget"] - (time.monotonic() - started)) + 0.1))
                delay = min(2 * delay, 30.0) * (0.75 + 0.5 * random.random())
                if _took_effect is not None and await _took_effect():
                    _outage_ended()
                    return 200, {}, None, b"{}"  # what `_call` unpacks; the response itself was lost
                continue
            _outage_ended()
            return result

    retried.budgeted = True
    return retried


@contextlib.contextmanager
def without_retries() -> Iterator[None]:
    """One attempt per request: for what a failing run does on its way out (releasing the lock), which must
    not wait out the retry budget; a lock left behind is taken over at the next start."""
    budget, _retry["budget"] = _retry["budget"], 0.0
    try:
        yield
    finally:
        _retry["budget"] = budget


def outage_note() -> str:
    """What to add to a storage error met during an outage: how long it was retried, and the flag."""
    if _retry["since"] is None:
        return ""
    return f" (cloud storage unavailable for {time.monotonic() - _retry['since']:.0f} s; storage.retry_seconds)"


def _outage_began(e: BaseException) -> None:
    if _retry["since"] is None:
        _retry["since"] = time.monotonic()
        warn(f"cloud storage request failed ({first_line(e, 120)}); retrying for up to {_retry['budget']:.0f} s"
             " (storage.retry_seconds)")


def _outage_ended() -> None:
    if _retry["since"] is not None:
        warn(f"cloud storage answers again after {time.monotonic() - _retry['since']:.0f} s")
        _retry["since"] = None


def _tensorstore_limits(budget: float, request_timeout: float) -> None:
    """TensorStore's GCS retries (default: 32 attempts, 1 s to 32 s apart): as many as fit in `budget`; a
    request that receives no byte for `request_timeout` fails (then is retried) instead of waiting for
    TensorStore's own limit (~60 s, measured on a silent socket).

    The timeout is curl's low-speed limit, read by TensorStore from the environment when it makes its first
    HTTP transport (JAX sets 60 s itself, on Cloud TPU VMs only); so it holds for processes that have not yet
    touched gs:// through TensorStore. The flag replaces what the environment had: it is the one setting.
    """
    os.environ["TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS"] = str(max(1, math.ceil(request_timeout)))
    os.environ["TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES"] = "1"
    try:
        from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
    except ImportError:
        return
    attempts, waited, delay = 0, 0.0, 1.0
    while waited < budget:
        waited, delay, attempts = waited + delay, min(2 * delay, 32.0), attempts + 1
    retries = {"max_retries": max(attempts, 1), "initial_delay": "1s", "max_delay": "32s"}
    for context in (ts_utils._BASE_TS_CONTEXT, ts_utils._DEFAULT_OCDBT_TS_CONTEXT):  # noqa: SLF001
        context["gcs_request_retries"] = retries


@contextlib.contextmanager
def storage_errors(what: str, path) -> Iterator[None]:
    """Turns a storage error into one line naming the path and the reason."""
    try:
        yield
    except StorageError:
        raise
    except storage_exceptions() as e:
        reason = oserror_reason(e)
        if isinstance(e, FileNotFoundError) and is_remote(path):  # gcsfs names only the request's URL
            reason = "not found (does the bucket exist, and may these credentials use it?)"
        raise StorageError(f"cannot {what} {path}: {reason}{outage_note()}") from None


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


# A composite GCS object is limited to 1,024 components (documented by Google); an appended object is rewritten
# as one plain object before it reaches this many, so a week-long run's metrics.jsonl never meets the limit.
MAX_COMPONENTS = 512


def append(path: epath.Path, data: str | bytes, components: int | None = None) -> int:
    """Appends to a file; returns how many components the object now has (1 on a local disk).

    A GCS object cannot be appended to: the data is uploaded as a part object and composed onto the object
    (GCS `compose`, atomic: readers see the object before or after the append), then the part is deleted. Each
    compose adds a component; once the object has MAX_COMPONENTS (GCS's `componentCount`, or `components` as
    counted by the caller where the server does not report it), the object is rewritten whole instead: one
    upload, one component. One writer at a time (the run directory's lock)."""
    path = epath.Path(path)
    data = data.encode() if isinstance(data, str) else data
    with storage_errors("write", path):
        if not is_remote(path):
            with path.open("ab") as f:
                f.write(data)
            return 1
        fs, key = _filesystem(path)
        fs.invalidate_cache(key)  # the generation the compose is conditioned on must be the object's own
        try:
            info = fs.info(key)
        except FileNotFoundError:
            fs.pipe_file(key, data)
            return 1
        count = max(int(info.get("componentCount", 1)), components or 1)
        if count >= MAX_COMPONENTS:
            fs.pipe_file(key, fs.cat_file(key) + data)
            fs.invalidate_cache(key)
            return 1
        part = f"{key}.part-{socket.gethostname()}-{os.getpid()}"
        fs.pipe_file(part, data)
        try:
            _compose_onto(fs, key, part, int(info["generation"]), int(info["size"]) + len(data))
        finally:
            fs.rm_file(part)
            fs.invalidate_cache(key)
        return count + 1


def _compose_onto(fs, key: str, part: str, generation: int, size: int) -> None:
    """Composes `part` onto the object `key`, once. gcsfs's `merge` is unconditioned: retried after its answer
    was lost, it appends the part a second time. Here the compose requires the object to be still at
    `generation` (GCS then refuses a repeat with HTTP 412), and before any retry the object is read back: if it
    has the `size` this compose makes, the lost attempt was carried out (one writer: the run's lock).

    Without the budgeted retry (`retry_storage_for` not called), gcsfs's own retries rely on the 412 alone."""
    bucket, name = key.split("/", 1)

    async def took_effect() -> bool:
        fs.invalidate_cache(key)
        return int((await fs._info(key))["size"]) == size  # noqa: SLF001 - the async call, inside the retry

    exactly_once = {"_took_effect": took_effect} if getattr(type(fs)._request, "budgeted", False) else {}  # noqa: SLF001
    try:
        # the source is the destination, whose generation ifGenerationMatch pins already
        fs.call("POST", "b/{}/o/{}/compose", bucket, name, ifGenerationMatch=str(generation), **exactly_once,
                headers={"Content-Type": "application/json"},
                json={"kind": "storage#composeRequest", "destination": {"name": name, "bucket": bucket},
                      "sourceObjects": [{"name": name}, {"name": part.split("/", 1)[1]}]})
    except FileExistsError:  # HTTP 412: the object moved on from `generation`
        from fsspec.asyn import sync

        if not sync(fs.loop, took_effect):
            raise OSError("the object changed under this append (another writer?); the append was not made") from None


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
        self.components = 1  # of the object on GCS: open_metrics has just rewritten it whole

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
            self.components = append(self.path, "".join(self._pending), self.components)
            self._pending.clear()
        self._last = time.monotonic()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        else:
            self.sync()


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


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
        self._generation, self._refresh_every, self.lock_error = 0, 60.0, None
        self._stop_refresh, self._refresher = threading.Event(), None
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

    def lock(self, refresh_every: float = 60.0) -> None:
        """Takes the run directory for this process, or raises naming the trainer that holds it."""
        self.create()
        holder = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": datetime.datetime.now().isoformat(timespec="seconds")}
        if self.remote:
            self._refresh_every = refresh_every
            holder.update(refreshed=_utc_now(), refresh_every=refresh_every)
            self._lock_object(holder)
            self._stop_refresh.clear()
            self._refresher = threading.Thread(target=self._refresh_lock, name="run-dir-lock", daemon=True)
            self._refresher.start()
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
        """On GCS, which has nothing like flock, the lock is the object .lock.json itself, a lease: created only
        if absent (an upload with the precondition ifGenerationMatch=0), refreshed by its holder every
        `refresh_every` seconds, deleted at exit. Every write is conditioned on the generation it replaces, which
        GCS checks atomically: of two trainers creating it, or taking over one dead holder's lock, exactly one
        succeeds and the other gets HTTP 412 and is refused. Each holder carries a random token, so a create or
        refresh whose response was lost and that is retried finds its own token on read-back and keeps the lock.
        A lock is a dead trainer's when its holder was a process of this host that no longer runs, or when it
        has not been refreshed for 10 refresh periods plus the retry budget (a lost VM); any other holder is
        refused, and the message names the object to delete once that trainer is known to be dead.
        """
        holder_file = self.path / HOLDER
        holder["token"] = uuid.uuid4().hex
        with storage_errors("write", holder_file):
            generation = self._write_holder(holder, if_generation=0)
            if generation is None:
                current, generation = self._read_holder_versioned(holder_file)
                if current.get("token") == holder["token"]:  # our own create, its response lost and retried
                    pass
                elif not current:  # released since: create it again
                    generation = self._write_holder(holder, if_generation=0)
                    if generation is None:
                        raise self._in_use(holder_file)
                elif self._dead(current):
                    warn(f"{self.path}: taking over the lock of a trainer that did not exit cleanly"
                         f" ({self._describe(current)})")
                    generation = self._write_holder(holder, if_generation=generation)
                    if generation is None:  # another starter took it over first
                        raise self._in_use(holder_file)
                else:
                    raise self._in_use(holder_file)
        self._lock = holder
        self._generation = generation

    def _write_holder(self, holder: dict, *, if_generation: int) -> int | None:
        """Uploads the holder object if its generation is still `if_generation` (0: if absent); the new
        generation, or None when the precondition failed (HTTP 412) and the read-back shows another holder."""
        from gcsfs.core import quote

        fs, key = _filesystem(self.path / HOLDER)
        bucket, name = key.split("/", 1)
        body = json.dumps(holder)
        data = (f'--==0==\nContent-Type: application/json; charset=UTF-8\n\n{json.dumps({"name": name})}\n--==0=='
                f'\nContent-Type: application/json\n\n{body}\n--==0==--').encode()
        try:
            # gcsfs's own uploads offer create-if-absent only: this is its multipart upload with any generation
            out = fs.call("POST", f"{fs._location}/upload/storage/v1/b/{quote(bucket)}/o",  # noqa: SLF001
                          uploadType="multipart", ifGenerationMatch=str(if_generation), data=data, json_out=True,
                          headers={"Content-Type": 'multipart/related; boundary="==0=="'})
        except FileExistsError:
            current, generation = self._read_holder_versioned(self.path / HOLDER)
            return generation if current.get("token") == holder["token"] and if_generation else None
        finally:
            fs.invalidate_cache(key)
        return int(out["generation"])

    @staticmethod
    def _read_holder_versioned(holder_file: epath.Path) -> tuple[dict, int]:
        fs, key = _filesystem(holder_file)
        fs.invalidate_cache(key)
        try:
            info = fs.info(key)
            holder = json.loads(fs.cat_file(key))
        except FileNotFoundError:
            return {}, 0  # released meanwhile: the next create may succeed
        except ValueError:
            holder = {}
        return (holder if isinstance(holder, dict) else {}), int(info.get("generation") or 0)

    def _dead(self, holder: dict) -> bool:
        if not holder:
            return False
        if self._died_here(holder):
            return True
        try:
            age = datetime.datetime.now(datetime.timezone.utc) - datetime.datetime.fromisoformat(holder["refreshed"])
            return age.total_seconds() > 10 * float(holder.get("refresh_every", self._refresh_every)) + _retry["budget"]
        except (KeyError, TypeError, ValueError):
            return False

    def _refresh_lock(self) -> None:
        """The lease's heartbeat (a thread): rewrites the holder object, conditioned on the generation this
        trainer wrote last. A failure (storage down past the retry budget, or the lock taken over by another
        trainer) is kept for `check_lock`, which the training loop calls."""
        holder_file = self.path / HOLDER
        while not self._stop_refresh.wait(self._refresh_every):
            holder = {**self._lock, "refreshed": _utc_now()}
            try:
                generation = self._write_holder(holder, if_generation=self._generation)
            except Exception as e:  # noqa: BLE001 - reported on the main thread
                self.lock_error = f"cannot refresh the lock {holder_file}: {oserror_reason(e)}{outage_note()}"
                return
            if generation is None:
                current, _ = self._read_holder_versioned(holder_file)
                self.lock_error = (f"{self.path}: the lock was taken over by another trainer"
                                   f" ({self._describe(current)}); this run stops so that one writer remains")
                return
            self._lock, self._generation = holder, generation

    def check_lock(self) -> None:
        """Raises if the lock's refresh failed: the run must not go on writing without holding it."""
        if self.lock_error is not None:
            raise StorageError(self.lock_error)

    @staticmethod
    def _died_here(holder: dict) -> bool:
        return holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int) \
            and not _pid_alive(holder["pid"])

    @staticmethod
    def _describe(h: dict) -> str:
        try:
            return f"host {h['host']}, pid {h['pid']}, started {h['started']}"
        except (KeyError, TypeError):
            return "holder unknown"

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
        return cls._describe(cls._read_holder(holder_file))

    def unlock(self) -> None:
        if self._lock is None:
            return
        holder_file = self.path / HOLDER
        if self.remote:
            self._stop_refresh.set()
            self._refresher.join(timeout=5)  # a refresh in flight would move the generation under the delete
            with contextlib.suppress(*storage_exceptions()), without_retries():
                current, generation = self._read_holder_versioned(holder_file)
                if current.get("token") == self._lock.get("token"):  # never another trainer's lock
                    fs, key = _filesystem(holder_file)
                    bucket, name = key.split("/", 1)
                    # conditioned too: a takeover between the read and the delete is not undone
                    fs.call("DELETE", "b/{}/o/{}", bucket, name, ifGenerationMatch=str(generation))
                    fs.invalidate_cache(key)
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
        """events.jsonl's records (trainer/goodput.py): every attempt's, never cut back by a resume. A torn
        last line is left out (and said, unless `say_torn` is False: a reader before `open_events`, which says
        it once when it repairs the file)."""
        return self._load_jsonl(self.path / "events.jsonl", repair=True, say_torn=say_torn)[0]

    def open_events(self, flush_every: float = 30.0) -> AppendLog:
        """events.jsonl opened for appending; a torn last line (a kill during its write) is dropped from the
        file first, as from metrics.jsonl."""
        path = self.path / "events.jsonl"
        records, torn = self._load_jsonl(path, repair=True)
        if torn:
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
                        warn(f"{path}: dropped a torn last line (a kill or a full disk during its write)")
                    return records, True
                raise StorageError(f"{path}: line {i + 1} is not a JSON record; fix or remove the file") from None
        return records, False

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
