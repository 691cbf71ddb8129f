"""The prepared corpus on disk: what `data.prepare` (the writer) and `data.loader` (the reader) both know.

    <out_dir>/
      train.bin | train-00000.bin, train-00001.bin, ...   little-endian uint16 token ids, each document followed
      val.bin   | val-00000.bin, ...                        by <|endoftext|> (nanoGPT's and llm.c's format)
      meta.json                                           the tokenizer, the files and token counts of each split,
                                                          the largest id, the settings that produced it

This module imports neither side, so the reader starts without the writer and the writer without JAX.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from data.tokenizer import EOT, RANKS_SHA256, TOKENIZER_NAME, VOCAB_SIZE

TOKEN_DTYPE = np.dtype("<u2")  # GPT-2's 50257 ids fit in uint16
META = "meta.json"
SPLITS = ("train", "val")
_TOKEN_FILE = re.compile(r"(train|val)(-\d{5})?\.bin")
_WRITER_KEYS = {"tokenizer_sha256", "train_files", "val_files", "source"}  # what marks data.prepare's meta.json


def shard_names(split: str, n_shards: int) -> list[str]:
    """The token files of a split: one gets nanoGPT's plain name (`train.bin`), more are numbered."""
    return [f"{split}.bin"] if n_shards == 1 else [f"{split}-{i:05d}.bin" for i in range(n_shards)]


def token_files(directory: Path) -> list[Path]:
    """Files in `directory` with the names token files get (whoever wrote them)."""
    return sorted(p for p in directory.glob("*.bin") if _TOKEN_FILE.fullmatch(p.name))


def make_meta(*, counts: dict[str, int], files: dict[str, list[str]], max_token_id: int, source: dict) -> dict:
    """meta.json's content: the tokenizer's identity, then each split's token count and files."""
    return {
        "tokenizer": TOKENIZER_NAME, "tokenizer_sha256": RANKS_SHA256, "vocab_size": VOCAB_SIZE,
        "eot": EOT, "dtype": TOKEN_DTYPE.name, "train_tokens": counts["train"], "val_tokens": counts["val"],
        "train_files": files["train"], "val_files": files["val"], "max_token_id": max_token_id, "source": source,
    }


def read_prepared_meta(directory: Path) -> dict | None:
    """The meta.json data.prepare wrote in `directory`; None when there is none or another program wrote it."""
    try:
        meta = json.loads((directory / META).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and _WRITER_KEYS <= meta.keys() else None
