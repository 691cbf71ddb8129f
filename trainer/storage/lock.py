"""One trainer per run directory: the lock `train.py` takes before it writes anything.

On a local disk (or NFS) the lock is an flock on `<run_dir>/.lock`, with the holder's host, pid and start time in
`.lock.json`; on cloud storage (`gs://`) it is the object `.lock.json` itself, a lease created only if absent and
refreshed by its holder. A dead holder's lock is taken over with one warning naming it; a live one's is refused
with a message naming it. All processes of a job count as one writer: process 0 takes the lock. No JAX.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import threading
import uuid

from etils import epath
from filelock import FileLock, Timeout

from errors import StorageError, warn
from trainer.storage.files import (
    atomic_write,
    filesystem,
    is_remote,
    oserror_reason,
    storage_errors,
    storage_exceptions,
)
from trainer.storage.retries import outage_note, retry_budget, without_retries

LOCK, HOLDER = ".lock", ".lock.json"


class RunDirLock:
    """The lock of the run directory at `path`: `acquire`, `check` (the lease still held), `release`."""

    def __init__(self, path: epath.Path):
        self.path = epath.Path(path)
        self.remote = is_remote(self.path)
        self._lock = None  # held: the FileLock (local), or the holder record (GCS)
        self._generation, self._refresh_every, self.error = 0, 60.0, None
        self._stop_refresh, self._refresher = threading.Event(), None

    def acquire(self, refresh_every: float = 60.0) -> None:
        """Takes the run directory (which exists) for this process, or raises naming the trainer that holds it."""
        holder = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": datetime.datetime.now().isoformat(timespec="seconds")}
        if self.remote:
            self._refresh_every = refresh_every
            holder.update(refreshed=_utc_now(), refresh_every=refresh_every)
            self._lock_object(holder)
            self._stop_refresh.clear()
            self._refresher = threading.Thread(target=self._refresh, name="run-dir-lock", daemon=True)
            self._refresher.start()
        else:
            self._lock_file()
            atomic_write(self.path / HOLDER, json.dumps(holder))

    def _lock_file(self) -> None:
        """An flock (the `filelock` library): the kernel releases it when its holder dies, however it dies, so
        a crashed trainer's lock is taken over (with a warning naming it) without anyone deleting files. flock
        is reliable on local disks; on NFS (Linux 2.6.12+ emulates it with POSIX byte-range locks) it needs a
        working lock manager, and gcsfuse and other object-store mounts do not lock at all."""
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
        from gcsfs.core import quote  # the optional `gcs` extra (a gs:// run directory needs it)

        fs, key = filesystem(self.path / HOLDER)
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
        fs, key = filesystem(holder_file)
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
            return age.total_seconds() > 10 * float(holder.get("refresh_every", self._refresh_every)) + retry_budget()
        except (KeyError, TypeError, ValueError):
            return False

    def _refresh(self) -> None:
        """The lease's heartbeat (a thread): rewrites the holder object, conditioned on the generation this
        trainer wrote last. A failure (storage down past the retry budget, or the lock taken over by another
        trainer) is kept for `check_lock`, which the training loop calls."""
        holder_file = self.path / HOLDER
        while not self._stop_refresh.wait(self._refresh_every):
            holder = {**self._lock, "refreshed": _utc_now()}
            try:
                generation = self._write_holder(holder, if_generation=self._generation)
            except Exception as e:  # noqa: BLE001 - reported on the main thread
                self.error = f"cannot refresh the lock {holder_file}: {oserror_reason(e)}{outage_note()}"
                return
            if generation is None:
                current, _ = self._read_holder_versioned(holder_file)
                self.error = (f"{self.path}: the lock was taken over by another trainer"
                                   f" ({self._describe(current)}); this run stops so that one writer remains")
                return
            self._lock, self._generation = holder, generation

    def check(self) -> None:
        """Raises if the lock's refresh failed: the run must not go on writing without holding it."""
        if self.error is not None:
            raise StorageError(self.error)

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

    def release(self) -> None:
        if self._lock is None:
            return
        holder_file = self.path / HOLDER
        if self.remote:
            self._stop_refresh.set()
            self._refresher.join(timeout=5)  # a refresh in flight would move the generation under the delete
            with contextlib.suppress(*storage_exceptions()), without_retries():
                current, generation = self._read_holder_versioned(holder_file)
                if current.get("token") == self._lock.get("token"):  # never another trainer's lock
                    fs, key = filesystem(holder_file)
                    bucket, name = key.split("/", 1)
                    # conditioned too: a takeover between the read and the delete is not undone
                    fs.call("DELETE", "b/{}/o/{}", bucket, name, ifGenerationMatch=str(generation))
                    fs.invalidate_cache(key)
        else:
            with contextlib.suppress(OSError):
                holder_file.unlink()
            self._lock.release()
        self._lock = None


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, TypeError, ValueError):
        pass
    return True

