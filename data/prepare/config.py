"""`PrepareConfig`: the flags of `python -m data.prepare`, their bounds, and which of them decide the output."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

from fields import Checked, Field
from errors import ConfigError

MIN_SHARD_TOKENS = 1 << 16


@dataclasses.dataclass(frozen=True)
class PrepareConfig(Checked):
    """Tokenize a source into token files."""

    source: Annotated[str, Field(
        "local files — a path, a directory or a glob of .txt, .json/.jsonl (JSON lines) or .parquet,"
        " .gz/.xz/.bz2/.zst compressed ok (not parquet) — or a hub dataset name (\"HuggingFaceFW/fineweb\"). A .txt"
        " file is one document")]
    out_dir: Annotated[str, Field("where train*.bin, val*.bin and meta.json go")]
    name: Annotated[str | None, Field('the hub dataset\'s configuration (e.g. "sample-10BT")')] = None
    split: Annotated[str, Field("the hub split to tokenize")] = "train"
    val_split: Annotated[str | None, Field(
        "a named hub validation split; when None, val_fraction of the documents are held out")] = None
    val_fraction: Annotated[float, Field(
        "fraction of documents held out for validation, each chosen by a seeded hash of its position; a source of"
        " one document gives its last val_fraction of tokens to validation", gt=0, lt=1)] = 0.0005
    text_field: Annotated[str, Field("the JSON / parquet / hub column that holds the text")] = "text"
    errors: Annotated[Literal["strict", "replace"], Field(
        'undecodable UTF-8: "strict" stops naming the file and byte offset, "replace" uses U+FFFD')] = "strict"
    max_documents: Annotated[int | None, Field(
        "stop after the first this many documents of the source (one worker only)", ge=1)] = None
    shard_tokens: Annotated[int, Field(
        "tokens per .bin file before a new one is started", ge=MIN_SHARD_TOKENS)] = 1 << 30
    seed: Annotated[int, Field("seed of the train/validation split", ge=0)] = 2357
    num_threads: Annotated[int, Field("tokenizer threads; 0: one per core this process may run on", ge=0)] = 0
    num_workers: Annotated[int, Field(
        "processes or hosts preparing one source into one shared out_dir together", ge=1)] = 1
    worker_index: Annotated[int, Field(
        "this worker's number in [0, num_workers); every worker runs the same command otherwise", ge=0)] = 0
    overwrite: Annotated[bool, Field(
        "replace what out_dir holds (otherwise re-running a finished corpus is a no-op and a partial one with the"
        " same settings is resumed)")] = False

    def cross_check(self) -> None:
        if "://" in self.out_dir:
            raise ConfigError(f"--out_dir {self.out_dir}: token files are written to (and memory-mapped from) a local"
                            " or mounted directory; mount the bucket with gcsfuse and pass the mount's path"
                            " (docs/pods.md, Token files on a pod)")
        if self.max_documents is not None and self.num_workers != 1:
            raise ConfigError("--max_documents needs --num_workers 1 (the first documents are a sequential notion)")
        if self.worker_index >= self.num_workers:
            raise ConfigError(f"--worker_index must be in [0, {self.num_workers}), got {self.worker_index}")

    def settings(self) -> dict:
        """What determines the output (recorded in meta.json; a partial run must match it to resume)."""
        skip = ("out_dir", "overwrite", "num_threads", "num_workers", "worker_index")
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}

