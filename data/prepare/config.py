"""`PrepareConfig`: the flags of `python -m data.prepare`, their bounds, and which of them decide the output."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from errors import DataError

MIN_SHARD_TOKENS = 1 << 16


@dataclasses.dataclass(frozen=True)
class PrepareConfig:
    """Tokenize a source into token files.

    Attributes:
      source: local files — a path, a directory or a glob of .txt, .json/.jsonl (JSON lines) or .parquet,
        .gz/.xz/.bz2/.zst compressed ok (not parquet) — or a hub dataset name ("HuggingFaceFW/fineweb").
        A .txt file is one document.
      out_dir: where train*.bin, val*.bin and meta.json go.
      name: the hub dataset's configuration (e.g. "sample-10BT").
      split: the hub split to tokenize.
      val_split: a named hub validation split; when None, `val_fraction` of the documents are held out.
      val_fraction: fraction of documents held out for validation, each chosen by a seeded hash of its
        position; a source of one document gives its last `val_fraction` of tokens to validation.
      text_field: the JSON / parquet / hub column that holds the text.
      errors: undecodable UTF-8: "strict" stops naming the file and byte offset, "replace" uses U+FFFD.
      max_documents: stop after the first this many documents of the source (one worker only).
      shard_tokens: tokens per .bin file before a new one is started (at least 65,536).
      seed: seed of the train/validation split.
      num_threads: tokenizer threads; 0: one per core this process may run on.
      num_workers: processes or hosts preparing one source into one shared out_dir together.
      worker_index: this worker's number in [0, num_workers); every worker runs the same command otherwise.
      overwrite: replace what out_dir holds (otherwise re-running a finished corpus is a no-op and a partial
        one with the same settings is resumed).
    """

    source: str
    out_dir: str
    name: str | None = None
    split: str = "train"
    val_split: str | None = None
    val_fraction: float = 0.0005
    text_field: str = "text"
    errors: Literal["strict", "replace"] = "strict"
    max_documents: int | None = None
    shard_tokens: int = 1 << 30
    seed: int = 2357
    num_threads: int = 0
    num_workers: int = 1
    worker_index: int = 0
    overwrite: bool = False

    def __post_init__(self):
        if "://" in self.out_dir:
            raise DataError(f"--out_dir {self.out_dir}: token files are written to (and memory-mapped from) a local"
                            " or mounted directory; mount the bucket with gcsfuse and pass the mount's path"
                            " (docs/pods.md, Token files on a pod)")
        if not (math.isfinite(self.val_fraction) and 0.0 < self.val_fraction < 1.0):
            raise DataError(f"--val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.shard_tokens < MIN_SHARD_TOKENS:
            raise DataError(f"--shard_tokens must be at least {MIN_SHARD_TOKENS:,}, got {self.shard_tokens}")
        if self.max_documents is not None and self.max_documents < 1:
            raise DataError(f"--max_documents must be at least 1, got {self.max_documents}")
        if self.max_documents is not None and self.num_workers > 1:
            raise DataError("--max_documents needs --num_workers 1 (the first documents are a sequential notion)")
        if self.num_threads < 0:
            raise DataError(f"--num_threads must be >= 0 (0: one per core), got {self.num_threads}")
        if self.num_workers < 1:
            raise DataError(f"--num_workers must be at least 1, got {self.num_workers}")
        if not 0 <= self.worker_index < self.num_workers:
            raise DataError(f"--worker_index must be in [0, {self.num_workers}), got {self.worker_index}")
        if self.errors not in ("strict", "replace"):
            raise DataError(f"--errors must be 'strict' or 'replace', got {self.errors!r}")

    def settings(self) -> dict:
        """What determines the output (recorded in meta.json; a partial run must match it to resume)."""
        skip = ("out_dir", "overwrite", "num_threads", "num_workers", "worker_index")
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}

