"""Orbax checkpoints of a run: train state, data-iterator state, and metadata (config, wandb run, data
position, corpus identity).

Orbax writes each step into a temporary directory and renames it when complete (on GCS, which cannot rename,
it writes `<step>/commit_success.txt` last), so `all_steps()` only ever sees whole checkpoints; a run killed
mid-save restarts from the previous one. A checkpoint that is complete
but damaged afterwards (a truncated or deleted file, garbled metadata, a foreign directory) is moved aside
by `restore_latest`, which then falls back to the newest one that restores.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from typing import Any, Callable

import grain
import jax
import orbax.checkpoint as ocp
from etils import epath

from configs.base import CheckpointConfig, Config
from errors import CheckpointError, DataError, UserError, first_line
from data.loader import position_file, restore_position, rows_consumed, seek
from trainer.run_dir import absolute, move, storage_errors, warn
from trainer.processes import all_agree, barrier, end_job, is_process_0

STATE, DATA, META = "state", "data", "meta"
DAMAGED = "checkpoints.damaged"  # beside checkpoints/: where unreadable checkpoints are moved, never deleted


class Checkpoints:
    """The run's `checkpoints/` directory."""

    def __init__(self, run_dir: str | os.PathLike, cfg: CheckpointConfig, *, read_only: bool = False,
                 save_statistics=None):
        run_dir = absolute(run_dir)  # Orbax wants absolute paths
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
        # save_statistics: an Orbax logger given each save's statistics (trainer/goodput.py's blocking times)
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

    def restore(self, step: int, abstract_state: Any, iterator=None) -> Any:
        """The state (onto the shardings in `abstract_state`: any mesh and device count) and, if given, the
        iterator in place: through Grain's handler when the process count is unchanged, otherwise from
        process 0's position, which is the same number for every process count."""
        args = {STATE: ocp.args.StandardRestore(abstract_state)}
        data_dir = self.path(step) / DATA
        own_file = position_file(data_dir, jax.process_index(), jax.process_count())
        if iterator is not None and own_file.exists():
            args[DATA] = grain.checkpoint.CheckpointRestore(iterator)
        state = self.manager.restore(step, args=ocp.args.Composite(**args))[STATE]
        if iterator is not None and not own_file.exists():
            restore_position(data_dir, iterator)
        return state

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


# ---- what a checkpoint must agree on with the run resuming it ---------------------------------------


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
    saved_optimizer = saved.get("config", {}).get("optim", {}).get("name", "adamw")
    if saved_optimizer != config.optim.name:
        diffs.append(f"optim.name: checkpoint {saved_optimizer!r} vs config {config.optim.name!r} (the optimizer"
                     " states differ; keep the optimizer, or start a new --run_dir)")
    if diffs:
        raise CheckpointMismatch(f"{where}: checkpoint does not fit this model: " + "; ".join(diffs))


def check_same_data(saved: dict, config: Config, corpus: dict, where) -> None:
    """Refuses to resume on other data: another corpus, window length or shuffle seed reads other rows."""
    train, data = saved.get("config", {}).get("train", {}), saved.get("config", {}).get("data", {})
    for key, old, new in (("train.seq_len", train.get("seq_len"), config.train.seq_len),
                          ("data.seed", data.get("seed"), config.data.seed)):
        if old != new:
            raise CheckpointMismatch(f"{where}: checkpoint was trained with {key}={old!r}, this run has {new!r},"
                                     " which reads other data; keep the value or start a new --run_dir")
    if "corpus" in saved and saved["corpus"] != corpus:
        raise CheckpointMismatch(
            f"{where}: checkpoint was trained on another corpus (data.dataset={data.get('dataset')!r}, now"
            f" {config.data.dataset!r}); its data position means nothing there: resume on the same corpus, or"
            " start a new --run_dir")


def check_same_schedule(saved: dict, config: Config, where) -> None:
    """Refuses a resume that would change the learning-rate schedule, unless train.reschedule is set."""
    if config.train.reschedule:
        return
    old = saved.get("config", {})
    o, t = old.get("optim", {}), old.get("train", {})
    if not o or "steps" not in t:
        return
    before = {"optim.lr": o.get("lr"), "optim.min_lr_ratio": o.get("min_lr_ratio"),
              "optim.warmup_steps": o.get("warmup_steps"), "decay": o.get("decay_steps") or t.get("steps")}
    c = config.optim
    now = {"optim.lr": c.lr, "optim.min_lr_ratio": c.min_lr_ratio, "optim.warmup_steps": c.warmup_steps,
           "decay": c.decay_steps or config.train.steps}
    changed = [k for k in before if before[k] != now[k]]
    if changed:
        name = {"decay": "optim.decay_steps (train.steps when unset)"}
        fields = "; ".join(f"{name.get(k, k)}: {before[k]} -> {now[k]}" for k in changed)
        keep = (f"keep the old values (to extend a run on its old schedule: --optim.decay_steps={before['decay']})"
                if "decay" in changed else "keep the old values")
        raise CheckpointMismatch(f"{where}: resuming would change the learning-rate schedule ({fields}); {keep},"
                                 " or pass --train.reschedule=True to accept the change")


def realign_data(saved: dict, config: Config, iterator, where) -> None:
    """Carries the restored data position over to this run's batch size (rows consumed are kept).

    Checkpoints record the rows of the global permutation they consumed (`data_rows`); older ones counted
    elements of steps_per_call × batch_size rows.
    """
    batch = config.train.batch_size
    train = saved.get("config", {}).get("train", {})
    try:
        if "data_rows" in saved:
            if train.get("batch_size") == batch:
                return  # the restored iterator is already there
            if saved["data_rows"] is None:
                raise DataError("the data position of a run with Grain worker processes cannot be regrouped;"
                                f" keep train.batch_size={train.get('batch_size')}")
            rows = saved["data_rows"]
        else:
            if not isinstance(train.get("steps_per_call"), int) or not isinstance(train.get("batch_size"), int):
                raise CheckpointError(f"{where}: checkpoint metadata lacks train.steps_per_call /"
                                      " train.batch_size, so its data position cannot be read; start a new --run_dir")
            rows = rows_consumed(iterator, train["steps_per_call"] * train["batch_size"])
        seek(iterator, rows, batch)
    except DataError as e:
        raise CheckpointMismatch(f"{where}: {e}") from None
