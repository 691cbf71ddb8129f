"""Orbax checkpoints of a run: train state, data-iterator state, and metadata (config, wandb id).

Orbax writes each step into a temporary directory and renames it when complete, so `latest_step()` only
ever sees whole checkpoints; a run killed mid-save restarts from the previous one.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from configs.base import CheckpointConfig, Config
from gpt2.config import ConfigError

STATE, DATA, META = "state", "data", "meta"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used for this run; the message says why."""


class Checkpoints:
    """The run's `checkpoints/` directory."""

    def __init__(self, run_dir: str | Path, cfg: CheckpointConfig, *, read_only: bool = False):
        self.directory = Path(run_dir).absolute() / "checkpoints"
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep,
            keep_period=cfg.keep_every,
            enable_async_checkpointing=cfg.async_save,
            create=not read_only,
            read_only=read_only,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=(STATE, DATA, META))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: Any, iterator, meta: dict, *, force: bool = False) -> bool:
        args = {STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta)}
        if iterator is not None:
            args[DATA] = grain.checkpoint.CheckpointSave(iterator)
        return self.manager.save(step, args=ocp.args.Composite(**args), force=force)

    def read_meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]

    def restore(self, step: int, abstract_state: Any, iterator=None) -> Any:
        """Restores the state (onto the shardings in `abstract_state`) and, if given, the iterator in place.

        The state restores onto any mesh and device count (Orbax reshards). The iterator restores through
        Grain's handler when the process count is unchanged, and otherwise from process 0's file: our
        loader's position (`next_index`, in K×B-row groups of one global permutation) is the same number
        in every process and for any process count.
        """
        args = {STATE: ocp.args.StandardRestore(abstract_state)}
        data_dir = self.directory / str(step) / DATA
        own_file = data_dir / f"process_{jax.process_index()}-of-{jax.process_count()}.json"
        if iterator is not None and own_file.exists():
            args[DATA] = grain.checkpoint.CheckpointRestore(iterator)
        state = self.manager.restore(step, args=ocp.args.Composite(**args))[STATE]
        if iterator is not None and not own_file.exists():
            _restore_other_process_count(data_dir, iterator)
        return state

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        """Only the parameters of a saved train state: evaluation reads neither the optimizer moments
        (twice the parameters' size) nor the data position."""
        target = {"params": abstract_params}
        args = ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                      partial_restore=True)
        with ocp.PyTreeCheckpointer() as checkpointer:
            return checkpointer.restore(self.directory / str(step) / STATE, args=args)["params"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def _restore_other_process_count(data_dir: Path, iterator) -> None:
    files = sorted(data_dir.glob("process_0-of-*.json"))
    if not files:
        raise CheckpointError(f"{data_dir}: no data-iterator state in this checkpoint")
    state = json.loads(files[0].read_text())
    if set(state) != {"next_index"}:
        raise CheckpointError(
            f"{files[0]}: the data-iterator state of a run with Grain workers cannot move to another"
            " process count; resume with the original number of processes"
        )
    iterator.set_state(state)


def check_compatible(saved: dict, config: Config, where: Path) -> None:
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
    if diffs:
        raise CheckpointError(f"{where}: checkpoint does not fit this model: " + "; ".join(diffs))


def check_same_data(saved: dict, config: Config, where: Path) -> None:
    """Refuses to resume on another permutation: a new window length or shuffle seed reads other data."""
    train, data = saved.get("config", {}).get("train", {}), saved.get("config", {}).get("data", {})
    for key, old, new in (("train.seq_len", train.get("seq_len"), config.train.seq_len),
                          ("data.seed", data.get("seed"), config.data.seed)):
        if old != new:
            raise CheckpointError(f"{where}: checkpoint was trained with {key}={old!r}, this run has {new!r},"
                                  " which reads other data; keep the value or start a new --run_dir")


def realign_data(saved: dict, config: Config, iterator, where: Path) -> None:
    """Carries the restored data position over when a resumed run groups its rows differently.

    The iterator counts elements of K×B rows of one seeded global permutation of windows. A new K
    (`train.steps_per_call`) or B (`train.batch_size`) keeps the rows already consumed: the position is
    converted (`check_same_data` has made sure the permutation is the same).
    """
    train = saved.get("config", {}).get("train", {})
    if not isinstance(train.get("steps_per_call"), int) or not isinstance(train.get("batch_size"), int):
        raise CheckpointError(f"{where}: checkpoint metadata lacks train.steps_per_call / train.batch_size, so its"
                              " data position cannot be read; start a new --run_dir")
    old_rows = train["steps_per_call"] * train["batch_size"]
    new_rows = config.train.steps_per_call * config.train.batch_size
    if old_rows == new_rows:
        return
    state = iterator.get_state()
    if set(state) != {"next_index"}:
        raise CheckpointError(f"{where}: cannot regroup the data position of a run with Grain workers; keep"
                              f" train.steps_per_call × train.batch_size = {old_rows}")
    consumed = state["next_index"] * old_rows
    if consumed % new_rows:
        raise CheckpointError(
            f"{where}: the checkpoint consumed {consumed} rows, not a whole number of steps_per_call ×"
            f" batch_size = {new_rows}; choose values whose product divides {consumed}"
        )
    iterator.set_state({"next_index": consumed // new_rows})


def config_from_meta(meta: dict) -> Config:
    """Rebuilds the run's Config from a checkpoint's metadata."""
    from configs import from_dict

    try:
        return from_dict(meta["config"])
    except (KeyError, TypeError, ConfigError) as e:
        raise CheckpointError(f"checkpoint metadata holds no usable config ({e})") from None


def to_json(config: Config) -> str:
    return json.dumps(dataclasses.asdict(config), indent=2)
