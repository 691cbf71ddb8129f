"""The commit protocol: how a worker resumes, and how workers share one out_dir, through its work area.

    <out_dir>/.prepare/
      settings.json                  what the parts depend on (config, units, file sizes); written once
      worker-<i>-of-<n>.lock         held by worker i of n while it runs
      unit-<k>.train.bin, .val.bin   unit k's tokens
      unit-<k>.json                  unit k's record (token and document counts): the commit
      finalize.lock                  held by the worker that joins the parts (data.prepare.shards)
      *.tmp-w<i>of<n>                worker i of n's files in progress

A unit's parts are written under temporary names, renamed into place, and the unit is committed by renaming
its record into place last: a record names complete parts, whenever the writer was killed. A rerun skips
committed units; worker i of n does units i, i+n, ... . Locks are flocks, which the kernel releases when their
holder dies however it dies, so a killed worker's lock never blocks its rerun.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Iterable, Iterator

import filelock

from data.format import META, read_prepared_meta, token_files
from data.prepare.config import PrepareConfig
from data.prepare.sources import Unit
from data.prepare.tokens import Tokens
from errors import DataError

STATE = ".prepare"  # the work area under out_dir; gone when the corpus is done


def finished(out: Path, cfg: PrepareConfig) -> bool:
    """Whether out_dir holds a corpus data.prepare finished and we are not asked to redo it.

    Raises when out_dir holds a meta.json another program wrote (unless `overwrite`).
    """
    meta = read_prepared_meta(out)
    if meta is not None and not cfg.overwrite and not (out / STATE).exists():
        return True
    if (out / META).exists() and meta is None and not cfg.overwrite:
        raise DataError(f"{out / META}: not written by data.prepare (pass --overwrite to replace it)")
    return False


@contextlib.contextmanager
def undone_if_refused(out: Path, cfg: PrepareConfig) -> Iterator[None]:
    """A run refused for its source (a DataError: no text, a row without the text field, a null text,
    undecodable bytes) leaves nothing it created: out_dir and its missing parents when they did not exist,
    else the work area when there was none. A killed or failing run (OSError: a full disk) keeps its work area
    to resume; so does a worker of several, whose work area the others share."""
    created = out
    while not created.parent.exists():
        created = created.parent
    if out.exists():
        created = out / STATE if not (out / STATE).exists() else None
    try:
        yield
    except WorkerRunning:
        raise  # what is there is the running worker's
    except DataError:
        if created is not None and cfg.num_workers == 1:
            shutil.rmtree(created, ignore_errors=True)
        raise


def claim(out: Path, cfg: PrepareConfig, units: list[Unit]) -> Path:
    """The work area for these settings: a partial run's with the same settings, or a new one. Returns it."""
    state, settings = out / STATE, _settings(cfg, units)
    old = read_json(state / "settings.json")
    if old is not None and old != settings:
        if not cfg.overwrite and any(state.glob("unit-*.json")):  # (with none committed there is nothing to keep)
            differ = sorted(k for k in settings.keys() | old.keys() if settings.get(k) != old.get(k))
            raise DataError(f"{out}: holds a partial run with other settings ({', '.join(differ)});"
                            " rerun it as it was, or pass --overwrite to start over")
        shutil.rmtree(state)
    if old is None and not cfg.overwrite:
        _refuse_foreign_token_files(out)
    for stale in out.glob(".tmp-prepare-*"):  # an earlier version's temporary directories
        shutil.rmtree(stale, ignore_errors=True)
    state.mkdir(parents=True, exist_ok=True)
    tmp = state / f"settings.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(settings))
    with contextlib.suppress(FileExistsError):
        os.link(tmp, state / "settings.json")  # first writer wins; the others checked equality above
    tmp.unlink()
    return state


def _refuse_foreign_token_files(out: Path) -> None:
    """Token files that a corpus data.prepare finished there does not list are someone else's: keep them."""
    meta = read_prepared_meta(out) or {"train_files": [], "val_files": []}
    ours = set(meta["train_files"] + meta["val_files"])
    foreign = sorted(p.name for p in token_files(out) if p.name not in ours)
    if foreign:
        raise DataError(f"{out}: holds {', '.join(foreign)} not written by data.prepare"
                        " (pass --overwrite to replace them)")


def _settings(cfg: PrepareConfig, units: list[Unit]) -> dict:
    """What a partial run's parts depend on: the config, the units and the source files' sizes."""
    sizes = {u.path: os.path.getsize(u.path) for u in units if u.kind != "hub"}
    settings = {**cfg.settings(), "units": [dataclasses.astuple(u) for u in units], "file_sizes": sizes}
    return json.loads(json.dumps(settings))  # tuples -> lists, as read back


def read_json(path: Path) -> dict | None:
    """A JSON file's content; None when it is absent or unreadable (not yet, or only partly, written)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ---- locks ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def lock(path: Path) -> Iterator[bool]:
    """An exclusive lock on `path` (created if absent) for the `with` block; yields whether it is held.

    Not held when another process holds it, or when the work area is gone (a worker finished the corpus).
    filelock's FileLock would create the missing directory again, so the file is opened here and only
    filelock's flock (`lock_descriptor`) is used.
    """
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR)
    except FileNotFoundError:
        yield False
        return
    try:
        yield filelock.lock_descriptor(fd, blocking=False)
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def worker_lock(state: Path, cfg: PrepareConfig) -> Iterator[None]:
    """This worker's lock for the `with` block; raises when the same worker already runs."""
    with lock(state / f"worker-{cfg.worker_index}-of-{cfg.num_workers}.lock") as held:
        if not held:
            raise WorkerRunning(f"{state.parent}: worker {cfg.worker_index} of {cfg.num_workers} is already running")
        yield


class WorkerRunning(DataError):
    """The same worker is already running on this out_dir."""


def remove_stale(state: Path, pattern: str) -> None:
    """Temporary files left by a killed run of a worker whose lock we now hold."""
    for p in state.glob(pattern):
        p.unlink(missing_ok=True)


def temporary_suffix(cfg: PrepareConfig) -> str:
    """The ending of this worker's files in progress, so that its rerun knows which to remove."""
    return f".tmp-w{cfg.worker_index}of{cfg.num_workers}"


# ---- units ---------------------------------------------------------------------------------------


def record_path(state: Path, unit: Unit) -> Path:
    return state / f"unit-{unit.index:05d}.json"


def part_path(state: Path, unit: Unit, split: str) -> Path:
    return state / f"unit-{unit.index:05d}.{split}.bin"


def todo(state: Path, units: list[Unit], cfg: PrepareConfig) -> list[Unit]:
    """This worker's units not yet committed."""
    return [u for u in units[cfg.worker_index :: cfg.num_workers] if not record_path(state, u).exists()]


def documents_left(state: Path, units: list[Unit], unit: Unit, max_documents: int | None) -> int | None:
    """max_documents minus the documents of the units before this one (one worker does them in order)."""
    if max_documents is None:
        return None
    return max_documents - sum(read_json(record_path(state, u))["documents"] for u in units[: unit.index])


def write_unit(state: Path, unit: Unit, batches: Iterable[Tokens], cfg: PrepareConfig) -> None:
    """Writes the unit's train/val parts and commits them by renaming its record into place."""
    suffix = temporary_suffix(cfg)
    record = {"train": 0, "val": 0, "documents": 0, "max_token_id": 0}
    paths = {s: part_path(state, unit, s) for s in ("train", "val")}
    with open(str(paths["train"]) + suffix, "wb") as ftrain, open(str(paths["val"]) + suffix, "wb") as fval:
        for tokens in batches:
            for split, f, ids in (("train", ftrain, tokens.train), ("val", fval, tokens.val)):
                f.write(ids.tobytes())
                record[split] += ids.size
                record["max_token_id"] = max(record["max_token_id"], int(ids.max(initial=0)))
            record["documents"] += tokens.documents
    for p in paths.values():
        os.replace(str(p) + suffix, p)
    tmp = Path(str(record_path(state, unit)) + suffix)
    tmp.write_text(json.dumps(record))
    os.replace(tmp, record_path(state, unit))


def all_records(state: Path, units: list[Unit]) -> list[dict] | None:
    """Every unit's record, or None while some unit is not committed."""
    records = [read_json(record_path(state, u)) for u in units]
    return None if None in records else records
