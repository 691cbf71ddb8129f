"""Orbax checkpoints of a run: train state, data-iterator state, and metadata (config, wandb run, data
position, corpus identity).

Orbax writes each step into a temporary directory and renames it when complete (on GCS, which cannot rename,
it writes `<step>/commit_success.txt` last), so `all_steps()` only ever sees whole checkpoints; a run killed
mid-save restarts from the previous one. A checkpoint that is complete but damaged afterwards (a truncated or
deleted file, garbled metadata, a foreign directory) is moved aside by `restore_latest`, which then falls back to
the newest one that restores. A save that fails (a full disk, an I/O error) ends the run in one line naming the
directory (`save_errors`), after the saves in flight have finished or failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import logging
import os
from typing import Any, Callable

import grain
import jax
import orbax.checkpoint as ocp
from etils import epath
# private, and no public path in this Orbax: the store its own default jax.Array handler is built with (without
# it, the handler writes no array metadata)
from orbax.checkpoint._src.metadata import array_metadata_store

from configs import from_dict
from configs.base import CheckpointConfig, Config
from errors import CheckpointError, TrainingError, UserError, first_line, warn
from trainer.processes import all_agree, barrier, end_job, is_process_0
from trainer.storage.files import absolute, move, storage_errors, storage_exceptions
from trainer.storage.retries import outage_note

STATE, DATA, META = "state", "data", "meta"
DAMAGED = "checkpoints.damaged"  # beside checkpoints/: where unreadable checkpoints are moved, never deleted

# Orbax's replica-parallel saving (on unless JAX_PLATFORMS names a GPU) has each replica of a shard write a slice
# of it, so a pod's save spreads its bytes over every host; each slice is a device op, compiled per shape on a
# process's first save. For slices under this size the ops cost more than the bytes they spread (a small run's
# first save compiled ~70 of them: docs/testing.md), so such arrays are written whole by one replica. Every
# matrix of gpt2_xl_pod on v5e-256 stays parallel (the smallest, wpe, at 25 KiB a slice).
MIN_REPLICA_SLICE_BYTES = 16 * 1024


class Checkpoints:
    """The run's `checkpoints/` directory."""

    def __init__(self, run_dir: str | os.PathLike, cfg: CheckpointConfig, *, read_only: bool = False,
                 save_statistics=None):
        run_dir = absolute(run_dir)  # Orbax wants absolute paths
        _write_small_arrays_from_one_replica()
        self.run_dir = run_dir
        self._before_save: list[Callable[[], None]] = []
        self.directory = run_dir / "checkpoints"
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep,
            keep_period=cfg.keep_every,
            enable_async_checkpointing=cfg.async_save,
            create=not read_only,
            read_only=read_only,
            # a save cut short by a kill leaves `<step>.orbax-checkpoint-tmp-*` (on GCS: `<step>/` without
            # commit_success.txt); Orbax removes those (on process 0) when the manager is created, never a
            # finished checkpoint. The run directory's lock is held by then: no other trainer is saving.
            cleanup_tmp_directories=not read_only,
        )
        # save_statistics: an Orbax logger given each save's statistics (trainer/telemetry/timeline.py's OrbaxSaveTimes)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=(STATE, DATA, META),
                                             logger=save_statistics)
        self._writer_failure = _WriterFailure(self.directory)
        if not read_only and jax.process_count() > 1:
            logging.getLogger("absl").addHandler(self._writer_failure)
        # train.py agrees on preemption through JAX's sync point, counting its calls; Orbax would report its
        # save steps to the same counter, and a stop agreed on "save step + 1" is a call number never reached
        self.manager.reached_preemption = lambda step: False

    def all_steps(self) -> list[int]:
        """The complete checkpoints on disk now (another process may be adding and rotating them)."""
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def path(self, step: int) -> epath.Path:
        return self.directory / str(step)

    def before_save(self, hook: Callable[[], None]) -> None:
        """Calls `hook` before each save: what must be durable before a checkpoint can exist (metrics.jsonl's
        records up to its step, which a resume from it keeps)."""
        self._before_save.append(hook)

    def save(self, step: int, state: Any, iterator, meta: dict) -> None:
        for hook in self._before_save:
            hook()
        args = {STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta)}
        if iterator is not None:
            args[DATA] = grain.checkpoint.CheckpointSave(iterator)
        self.manager.save(step, args=ocp.args.Composite(**args), force=True)

    def read_meta(self, step: int) -> dict:
        """The checkpoint's metadata, or a CheckpointError naming it and the reason."""
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
        except Exception as e:  # noqa: BLE001 - Orbax reports a damaged item with many exception types
            self._raise_if_gone(step)
            raise CheckpointDamaged(f"{self.path(step)}: unreadable metadata ({first_line(e)})") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
            raise CheckpointDamaged(f"{self.path(step)}: metadata holds no config")
        return meta

    def restore(self, step: int, abstract_state: Any) -> Any:
        """The state, onto the shardings in `abstract_state` (any mesh and device count)."""
        args = ocp.args.Composite(**{STATE: ocp.args.StandardRestore(abstract_state)})
        return self.manager.restore(step, args=args)[STATE]

    def restore_iterator(self, step: int, iterator) -> None:
        """The Grain iterator set in place from this process's own saved state (the data position's owner,
        trainer/run/data_position.py, decides when that is the one to use)."""
        self.manager.restore(step, args=ocp.args.Composite(**{DATA: grain.checkpoint.CheckpointRestore(iterator)}))

    def restore_latest(self, attempt: Callable[[int, dict], Any]) -> tuple[int, dict, Any] | None:
        """(step, meta, attempt(step, meta)) for the newest checkpoint that restores, or None when there is none.

        A checkpoint that fails to restore for a reason in the checkpoint itself (a file missing, truncated or
        garbled) is reported in one line, moved aside to `checkpoints.damaged/` and the next older one is
        tried. A refusal by this run's config (another model shape, corpus, schedule; a data position that
        cannot be carried over) and a device out of memory are not damage: they propagate. If checkpoints were
        there and none restores, the run stops rather than silently starting from scratch.
        """
        moved = []
        for step in reversed(self.all_steps()):
            try:
                meta = self.read_meta(step)
                result = attempt(step, meta)
                failure = None
            except CheckpointError as e:
                if not isinstance(e, CheckpointDamaged):
                    raise
                failure = e
            except UserError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure to read a file of this checkpoint
                if "RESOURCE_EXHAUSTED" in str(e):
                    raise
                failure = CheckpointDamaged(f"{self.path(step)}: cannot be restored ({first_line(e)})")
            if not all_agree(failure is None):
                moved.append(self.move_aside(step, failure or CheckpointDamaged(f"{self.path(step)}: another"
                                                                               " process failed to restore it")))
                continue
            return step, meta, result
        if moved:
            raise CheckpointError(f"{self.directory}: no checkpoint restores (the damaged ones are in "
                                  f"{moved[0].parent}); move one back, or start a new --run_dir")
        return None

    def move_aside(self, step: int, failure: Exception) -> epath.Path:
        """Moves a damaged checkpoint out of Orbax's sight (never deletes it) and says so in one line."""
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        target = self.run_dir / DAMAGED / f"{step}-{stamp}"
        if is_process_0():
            with storage_errors("move a damaged checkpoint to", target):
                move(self.path(step), target)
            warn(f"{str(failure).rstrip('.')}; moved it to {target} and trying the previous checkpoint")
        barrier(f"move-aside-{step}")
        self.manager.reload()
        return target

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        """Only the parameters of a saved train state: evaluation reads neither the optimizer moments
        (twice the parameters' size) nor the data position."""
        target = {"params": abstract_params}
        args = ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                      partial_restore=True)
        try:
            with ocp.PyTreeCheckpointer() as checkpointer:
                return checkpointer.restore(self.path(step) / STATE, args=args)["params"]
        except Exception as e:  # noqa: BLE001
            self._raise_if_gone(step)
            raise CheckpointDamaged(f"{self.path(step)}: cannot be restored ({first_line(e)})") from None

    def _raise_if_gone(self, step: int) -> None:
        if not self.path(step).exists():
            raise CheckpointGone(f"{self.path(step)}: removed while evaluating (a training run rotating its"
                                 " checkpoints?)") from None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()
        logging.getLogger("absl").removeHandler(self._writer_failure)


@functools.cache  # once per process
def _write_small_arrays_from_one_replica() -> None:
    """jax.Array's Orbax handler as Orbax registers it, with MIN_REPLICA_SLICE_BYTES as its replica-parallel gate."""
    handler = ocp.type_handlers.ArrayHandler(array_metadata_store=array_metadata_store.Store(),
                                             min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES)

    def not_this_override(record: logging.LogRecord) -> bool:  # Orbax warns of every override; this one is ours
        return not str(record.msg).startswith("Type handler registry")

    absl = logging.getLogger("absl")
    absl.addFilter(not_this_override)
    try:
        ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
    finally:
        absl.removeFilter(not_this_override)


class _WriterFailure(logging.Handler):
    """Ends the job when an Orbax writer thread fails (a full disk, an I/O error), as soon as Orbax logs it.

    With several processes an asynchronous save that fails on one process leaves every process waiting in
    Orbax's commit barriers (the failed writer never arrives) until Orbax's timeout (10 minutes), and the main
    threads wait in the next save behind them: the failure would never reach the loop in time. Orbax's
    background thread logs the failure (absl logging, with the exception) before it stores it; that record
    is the one place it can be seen at once.
    """

    def __init__(self, directory):
        super().__init__(logging.ERROR)
        self.directory = directory

    def emit(self, record: logging.LogRecord) -> None:
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and "Failed to run" in record.getMessage():
            end_job(f"could not save checkpoint in {self.directory}: {_ends(first_line(error, 10_000))}")


def _ends(text: str, keep: int = 140) -> str:
    """A long error (TensorStore's name every path it passed) cut in the middle: its start says what failed,
    its end why."""
    return text if len(text) <= 2 * keep else f"{text[:keep]} ... {text[-keep:]}"


class CheckpointDamaged(CheckpointError):
    """A file of the checkpoint is missing, truncated or unreadable."""


class CheckpointGone(CheckpointError):
    """The checkpoint was deleted (a running trainer keeps only the newest few)."""


class CheckpointMismatch(CheckpointError):
    """The checkpoint is intact but does not fit this run's config (model shape, data order, corpus)."""


def config_from_meta(meta: dict, where) -> Config:
    """Rebuilds the run's Config from a checkpoint's metadata."""
    try:
        return from_dict(meta["config"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: metadata holds no usable config ({e})") from None


# ---- whether a checkpoint fits this model -------------------------------------------------------------


def check_compatible(saved: dict, config: Config, where) -> None:
    """Refuses a checkpoint whose model differs from the configured one, naming the differing fields."""
    saved_model = saved.get("config", {}).get("model", {})
    current = dataclasses.asdict(config.model)
    # fields that change the parameters' shapes or meaning (dtype/remat/scan/attention impl. are free)
    keys = ("vocab_size", "pad_vocab_to", "block_size", "n_layer", "n_head", "n_embd", "bias")
    diffs = [f"model.{k}: checkpoint {saved_model.get(k)!r} vs config {current[k]!r}"
             for k in keys if saved_model.get(k) != current[k]]
    if "scan_layers" in saved_model and saved_model["scan_layers"] != current["scan_layers"]:
        diffs.append(f"model.scan_layers: checkpoint {saved_model['scan_layers']!r} vs config"
                     f" {current['scan_layers']!r} (parameter layouts differ)")
    # the parametrization and μP's fields give the same parameters another meaning (init, multipliers); a field
    # a checkpoint predates is at its default (a checkpoint from before μP is a standard one)
    saved_parametrization = saved_model.get("parametrization", "standard")
    if saved_parametrization != current["parametrization"]:
        diffs.append(f"model.parametrization: checkpoint {saved_parametrization!r} vs config"
                     f" {current['parametrization']!r}")
    elif current["parametrization"] == "mup":
        mup = {f.name: f.default for f in dataclasses.fields(config.model) if f.name.startswith("mup_")}
        diffs += [f"model.{k}: checkpoint {saved_model.get(k, default)!r} vs config {current[k]!r}"
                  for k, default in mup.items() if saved_model.get(k, default) != current[k]]
    saved_optimizer = saved.get("config", {}).get("optim", {}).get("name", "adamw")
    if saved_optimizer != config.optim.name:
        diffs.append(f"optim.name: checkpoint {saved_optimizer!r} vs config {config.optim.name!r} (the optimizer"
                     " states differ)")
    if diffs:
        raise CheckpointMismatch(f"{where}: checkpoint does not fit this model: " + "; ".join(diffs))


# ---- checkpoint writes that fail ------------------------------------------------------------------


class SaveFailed(TrainingError):
    """Writing a checkpoint failed (disk full, I/O error)."""

    abandon_threads = True  # Orbax's writer threads are mid-failure; nothing is left worth flushing


@contextlib.contextmanager
def save_errors(ckpt: Checkpoints):
    """A failed checkpoint write (disk full, I/O error, permissions) becomes one line. Asynchronous writes
    report their failure at the next save or wait, so both go through here."""
    try:
        yield
    except (ValueError, RuntimeError, *storage_exceptions()) as e:
        if isinstance(e, UserError):
            raise
        raise SaveFailed(f"could not save checkpoint in {ckpt.directory}: {first_line(e)}{outage_note()}") from None


@contextlib.contextmanager
def finishing_saves(ckpt: Checkpoints):
    """A run stopped by a user-facing error (divergence, a bad token id, a full disk at metrics.jsonl)
    first lets the checkpoint writes in flight finish, so none is abandoned half-written."""
    try:
        yield
    except UserError as e:
        if not isinstance(e, SaveFailed):
            with contextlib.suppress(Exception):
                ckpt.wait()
        raise
