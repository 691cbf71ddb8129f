"""Paths on a local disk or on cloud storage (`gs://bucket/path`), and the writes the run directory relies on.

Paths are `etils.epath` paths, the abstraction Orbax itself uses; `gs://` goes through fsspec's `gcsfs`, which is
imported only when such a path is used (the `gcs` extra). Every whole-file write is atomic: on a local disk a
temporary file renamed over the old one, on GCS a single object upload (readers see the old or the new object).
Appending differs: a local file is appended to; GCS objects cannot be appended to, so an appended text is uploaded
as a part object and composed onto the object (`append`). No JAX.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from typing import Iterator

from etils import epath
from etils.epath import backend
from fsspec.asyn import sync

from errors import StorageError, first_line
from trainer.storage.retries import outage_note


def is_remote(path) -> bool:
    """Whether a path is on an object store (`gs://...`) rather than a local or mounted filesystem."""
    return "://" in os.fspath(path)  # epath hands `scheme://...` paths to fsspec (gcsfs for gs://)


def absolute(path) -> epath.Path:
    """A local path made absolute (Orbax wants absolute paths), a `gs://` path as it is."""
    return epath.Path(path) if is_remote(path) else epath.Path(os.path.abspath(os.path.expanduser(path)))


def filesystem(path):
    """(fsspec filesystem, its path) of an object-store path: epath's own cached instance, so that listings
    cached by one are never stale in the other."""
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
        fs, key = filesystem(path)
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
        if not sync(fs.loop, took_effect):
            raise OSError("the object changed under this append (another writer?); the append was not made") from None


def move(src: epath.Path, dst: epath.Path) -> None:
    """Moves a file or a directory (on GCS: copies each object, then deletes it; epath's rename there
    insists on a destination folder, which object stores do not have)."""
    if not is_remote(src):
        dst.parent.mkdir(parents=True, exist_ok=True)
        src.rename(dst)
        return
    fs, key = filesystem(src)
    fs.mv(key, filesystem(dst)[1], recursive=True)
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

