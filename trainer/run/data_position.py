"""The data position: how far into the corpus a run has read, as a checkpoint keeps it and a resume restores it.

Every process strides over the same global permutation (data/loader.py), so the iterator's position — Grain's
`next_index`, global batches consumed — is the same number in every process, and `next_index × batch_size` is
the rows of the permutation read: the same whatever the number of processes. This module owns that number: it
reads it (`rows_consumed`), sets it (`seek`), restores it from a checkpoint written by any number of processes,
carries it over to another batch size (`realign`), and refuses a resume on data where it means nothing
(`check_same_data`).
"""

from __future__ import annotations

import json

import jax

from configs.base import Config
from data.loader import Corpus
from errors import CheckpointError, DataError
from trainer.storage.checkpoints import DATA, CheckpointMismatch, Checkpoints


def rows_consumed(iterator, batch_size: int) -> int:
    """Rows of the global permutation this run has read: `next_index` counts global batches of `batch_size`."""
    state = iterator.get_state()
    if set(state) != {"next_index"}:
        raise DataError("the data position of a loader with Grain worker processes cannot be regrouped; keep"
                        " train.batch_size (or set data.num_workers=0)")
    return state["next_index"] * batch_size


def rows_consumed_or_none(iterator, batch_size: int) -> int | None:
    """What a checkpoint records as its `data_rows`: None with Grain worker processes (whose position Grain's
    own state keeps exactly, but which cannot be regrouped to another batch size)."""
    try:
        return rows_consumed(iterator, batch_size)
    except DataError:
        return None


def seek(iterator, rows: int, batch_size: int) -> None:
    """Moves the iterator to `rows` rows of the global permutation (a whole number of batches)."""
    if rows % batch_size:
        raise DataError(f"the data position ({rows} rows) is not a whole number of batches of {batch_size};"
                        f" choose a train.batch_size that divides {rows}")
    iterator.set_state({"next_index": rows // batch_size})


def restore(ckpt: Checkpoints, step: int, iterator) -> None:
    """Sets the iterator to checkpoint `step`'s position: through Grain's own handler when the process count is
    unchanged, otherwise from process 0's state (the same number for every process count)."""
    data_dir = ckpt.path(step) / DATA
    if (data_dir / _state_file(jax.process_index(), jax.process_count())).exists():
        ckpt.restore_iterator(step, iterator)
        return
    files = sorted(data_dir.glob("process_0-of-*.json"))
    if not files:
        raise DataError(f"{data_dir}: no data-iterator state in this checkpoint")
    state = json.loads(files[0].read_text())
    if set(state) != {"next_index"}:
        raise DataError(f"{files[0]}: the data-iterator state of a run with Grain workers cannot move to another"
                        " process count; resume with the original number of processes")
    iterator.set_state(state)


def _state_file(process_index: int, process_count: int) -> str:
    """Grain's per-process iterator state inside a checkpoint's data item."""
    return f"process_{process_index}-of-{process_count}.json"


def realign(saved: dict, config: Config, iterator, where) -> None:
    """Carries the restored position over to this run's batch size (rows consumed are kept).

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


def corpus_identity(corpus: Corpus) -> dict:
    """What a checkpoint records of its corpus, to refuse resuming on another one."""
    m = corpus.meta
    return {"train_tokens": m.get("train_tokens"), "train_files": m.get("train_files"), "source": m.get("source")}


def check_same_data(saved: dict, config: Config, corpus: Corpus, where) -> None:
    """Refuses to resume on other data: another corpus, window length or shuffle seed reads other rows."""
    train, data = saved.get("config", {}).get("train", {}), saved.get("config", {}).get("data", {})
    for key, old, new in (("train.seq_len", train.get("seq_len"), config.train.seq_len),
                          ("data.seed", data.get("seed"), config.data.seed)):
        if old != new:
            raise CheckpointMismatch(f"{where}: checkpoint was trained with {key}={old!r}, this run has {new!r},"
                                     " which reads other data; keep the value or start a new --run_dir")
    if "corpus" in saved and saved["corpus"] != corpus_identity(corpus):
        raise CheckpointMismatch(
            f"{where}: checkpoint was trained on another corpus (data.dataset={data.get('dataset')!r}, now"
            f" {config.data.dataset!r}); its data position means nothing there: resume on the same corpus, or"
            " start a new --run_dir")
