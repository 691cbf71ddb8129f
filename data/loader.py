"""Grain loading of prepared token files into the global batches the train step consumes.

The pipeline (Grain's dataset API):

    TokenWindows (memory-mapped .bin files, window i = tokens[i·T : i·T + T + 1])
      .shuffle(seed).repeat()        a fresh seeded permutation every epoch
      [process_index::process_count] process p reads global positions p, p+P, p+2P, ...
      .batch(B_local)                this process's rows of one global batch: [B_local, T + 1]
      .to_iter_dataset()             checkpointable iterator (Orbax, via grain.checkpoint)

Because every process strides over the *same* global permutation, the rows of global batch b are the same
set whatever the number of processes: a 2-process run sees the data a 1-process run sees, and the iterator's
position (`next_index`, global batches consumed) is the same number in every process; trainer/run/data_position.py
owns that number (reading, setting and restoring it).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path

import grain
import jax
import numpy as np
from absl import flags
from jax.sharding import NamedSharding

from data.format import META, TOKEN_DTYPE
from data.orphans import end_with_parent
from data.tokenizer import RANKS_SHA256
from errors import DataError


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A prepared corpus directory, validated."""

    directory: Path
    meta: dict

    def files(self, split: str) -> list[Path]:
        return [self.directory / name for name in self.meta[f"{split}_files"]]


def open_corpus(directory: str | os.PathLike, *, vocab_size: int, min_tokens: int) -> Corpus:
    """Checks a prepared corpus against its meta.json and the model: tokenizer, vocabulary, file sizes (a
    truncated or padded copy is refused), the largest id, enough tokens for one window."""
    directory = Path(directory)
    meta_path = directory / META
    if directory.is_file():  # a source (a .jsonl, a .txt) given where its prepared corpus belongs
        raise DataError(f"{directory} is a file, not a prepared corpus directory; tokenize it first: python -m"
                        f" data.prepare --source {directory} --out_dir DIR, then pass DIR (docs/data.md)")
    if not directory.is_dir():
        raise DataError(f"{directory}: no such corpus directory; prepare one there: python -m data.prepare --source"
                        f" YOUR_FILES --out_dir {directory} (docs/data.md)")
    if not meta_path.is_file():
        raise DataError(f"{meta_path}: missing, so {directory} is not a prepared corpus; prepare one there: python -m"
                        f" data.prepare --source YOUR_FILES --out_dir {directory} (docs/data.md)")
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError as e:
        raise DataError(f"{meta_path}: not a meta.json written by data.prepare ({e})") from None
    if not isinstance(meta, dict):
        raise DataError(f"{meta_path}: not a meta.json written by data.prepare (not a JSON object)")
    if meta.get("tokenizer_sha256") != RANKS_SHA256:
        raise DataError(
            f"{meta_path}: tokenized with {meta.get('tokenizer')!r} (sha256"
            f" {str(meta.get('tokenizer_sha256'))[:12]}…), not the GPT-2 BPE this model uses"
        )
    if meta.get("vocab_size", 0) > vocab_size:
        raise DataError(f"{meta_path}: vocab_size {meta.get('vocab_size')} exceeds the model's {vocab_size}")
    max_id = meta.get("max_token_id")  # recorded by data.prepare; absent in hand-made corpora
    if isinstance(max_id, int) and max_id >= vocab_size:
        raise DataError(f"{meta_path}: holds token id {max_id}, >= the model's vocabulary of {vocab_size}")
    corpus = Corpus(directory, meta)
    for split in ("train", "val"):
        _check_split(corpus, split, min_tokens)
    return corpus


def _check_split(corpus: Corpus, split: str, min_tokens: int) -> None:
    meta_path = corpus.directory / META
    files = corpus.files(split)
    if not files:
        raise DataError(f"{meta_path}: lists no {split} files")
    total = 0
    for f in files:
        if not f.is_file():
            raise DataError(f"{f}: missing (listed in {meta_path})")
        size = f.stat().st_size
        if size % TOKEN_DTYPE.itemsize:
            raise DataError(f"{f}: {size} bytes is not a whole number of uint16 tokens (truncated?)")
        total += size // TOKEN_DTYPE.itemsize
    expected = corpus.meta.get(f"{split}_tokens")
    if isinstance(expected, int) and total != expected:
        names = files[0].name if len(files) == 1 else f"{len(files)} {split} files"
        raise DataError(f"{corpus.directory}: {names} hold {total:,} tokens but {META} says {expected:,}"
                        " (a truncated or altered copy?); copy the corpus again or re-run data.prepare")
    if total < min_tokens:
        more = "a larger --val_fraction" if split == "val" else "more text"
        raise DataError(
            f"{corpus.directory}: the {split} split has {total:,} tokens, fewer than one window of seq_len + 1 ="
            f" {min_tokens:,}; lower train.seq_len (eval.py: --seq_len) below {total:,}, or prepare the corpus"
            f" again with {more}"
        )


class TokenWindows(grain.sources.RandomAccessDataSource):
    """Non-overlapping windows of `seq_len + 1` tokens (inputs and their next-token targets).

    Memory maps are opened lazily so the source pickles cheaply into Grain worker processes.
    """

    def __init__(self, files: list[Path], seq_len: int, vocab_size: int):
        self.files = [str(f) for f in files]
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        tokens = np.array([os.path.getsize(f) // TOKEN_DTYPE.itemsize for f in self.files])
        # consecutive windows share one token: window i covers [i·T, i·T + T] inclusive
        self._starts = np.concatenate([[0], np.cumsum((tokens - 1) // seq_len)])
        self._maps: dict[int, np.memmap] = {}

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int) -> np.ndarray:  # [T + 1] int32
        # The range check stays for hand-made corpora (data.prepare records max_token_id, checked at start-up).
        f = int(np.searchsorted(self._starts, index, side="right")) - 1
        if f not in self._maps:
            self._maps[f] = np.memmap(self.files[f], dtype=TOKEN_DTYPE, mode="r")
        start = (index - int(self._starts[f])) * self.seq_len
        window = np.asarray(self._maps[f][start : start + self.seq_len + 1], dtype=np.int32)
        if window.max() >= self.vocab_size:
            raise DataError(
                f"{self.files[f]}: token id {window.max()} at or after offset {start} is >= vocab size"
                f" {self.vocab_size}; re-prepare the corpus with `python -m data.prepare`"
            )
        return window

    def __getstate__(self):
        return {**self.__dict__, "_maps": {}}

    def __repr__(self) -> str:
        return f"TokenWindows({len(self.files)} files, seq_len={self.seq_len}, {len(self)} windows)"


@dataclasses.dataclass(frozen=True)
class LoaderConfig:
    """How a split is read (sizes are per process)."""

    seq_len: int
    batch_size: int  # rows per process per step
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = None  # None: repeat forever
    num_workers: int = 0  # Grain worker processes (0: read in the main process)
    prefetch: int = 2  # elements buffered ahead by a reader thread (0: read on demand), or per worker


def make_dataset(
    files: list[Path], vocab_size: int, cfg: LoaderConfig, *,
    shard_index: int | None = None, shard_count: int | None = None,
) -> grain.IterDataset:
    """The Grain pipeline for one process. Shard defaults: this JAX process of all of them."""
    if shard_index is None or shard_count is None:
        opts = grain.sharding.ShardByJaxProcess(drop_remainder=True)
        shard_index, shard_count = opts.shard_index, opts.shard_count
    source = TokenWindows(files, cfg.seq_len, vocab_size)
    ds = grain.MapDataset.source(source)
    if cfg.shuffle:
        ds = ds.shuffle(seed=cfg.seed)
    if cfg.num_epochs != 1:
        ds = ds.repeat(cfg.num_epochs)
    ds = ds[shard_index::shard_count]
    ds = ds.batch(cfg.batch_size, drop_remainder=True)  # [B_local, T + 1]
    # One reader thread: reading a window is a memmap slice that holds the GIL, so a second thread only
    # contends for it (measured 7.5 vs 4.7 M tokens/s at T 1024, B 8); worker processes are the way to scale.
    read = grain.ReadOptions(num_threads=1 if cfg.prefetch else 0, prefetch_buffer_size=cfg.prefetch)
    it = ds.to_iter_dataset(read)
    if cfg.num_workers > 0:
        if not flags.FLAGS.is_parsed():  # Grain's workers read absl flags; we have no absl main
            flags.FLAGS.mark_as_parsed()
        # each worker ends with this process, even when it is killed (data/orphans.py)
        it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.num_workers),
                            worker_init_fn=functools.partial(end_with_parent, os.getpid()))
    return it


def to_global(local: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """This process's rows [..., B_local, T+1] -> one global [..., B, T+1] array sharded over the batch axes."""
    return jax.make_array_from_process_local_data(sharding, local)
