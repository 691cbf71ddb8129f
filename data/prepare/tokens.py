"""The tokenize stage: each document's side of the train/validation split, and tiktoken on threads.

tiktoken releases the GIL while it encodes, so threads of one process scale to the cores without copying text
between processes. Output order is input order, whatever the number of threads or the batch size.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator, NamedTuple

import numpy as np

from data.format import TOKEN_DTYPE
from data.prepare.config import PrepareConfig
from data.prepare.sources import Document, Unit
from data.tokenizer import EOT, get_tokenizer

BATCH_CHARS = 1 << 20  # text per tokenizer task: large enough to amortize a task, small enough to keep memory flat


class Labeled(NamedTuple):
    """A document (or piece) with the split it goes to."""

    val: bool
    text: str
    last: bool  # the document's last piece: <|endoftext|> follows it


@dataclasses.dataclass
class Tokens:
    """One batch's tokens, each document followed by <|endoftext|>."""

    train: np.ndarray
    val: np.ndarray
    documents: int  # documents that ended in this batch


def is_val(seed: int, file_no: int, position: int, fraction: float) -> bool:
    """Whether a document goes to validation: a seeded hash of where it is, uniform in [0, 1).

    A hash of the position, not a random stream, so that the split is the same for any batch size, thread
    count, number of workers or interruption.
    """
    digest = hashlib.blake2b(f"{seed}:{file_no}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


def assign(docs: Iterable[Document], unit: Unit, cfg: PrepareConfig) -> Iterator[Labeled]:
    """The unit's documents with their split: `is_val` decides per document, unless the source names a
    validation split (then its units are all validation, the others all train)."""
    for position, text, last in docs:
        val = unit.all_val if cfg.val_split is not None else is_val(cfg.seed, unit.file_no, position,
                                                                     cfg.val_fraction)
        yield Labeled(val, text, last)


def tokenize(docs: Iterable[Labeled], threads: int = 0) -> Iterator[Tokens]:
    """Tokens per batch of ~BATCH_CHARS of text, in order, encoded on `threads` threads (0: one per core this
    process may run on). The next batches are read while the threads encode; at most two per thread wait."""
    threads = threads or len(os.sched_getaffinity(0))
    with ThreadPoolExecutor(threads) as pool:
        pending: collections.deque = collections.deque()
        for batch in batches(docs):
            pending.append(pool.submit(encode, batch))
            if len(pending) > 2 * threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def batches(docs: Iterable[Labeled]) -> Iterator[list[Labeled]]:
    """Consecutive documents in lists of at least BATCH_CHARS characters (the last one may be shorter)."""
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += len(doc.text)
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def encode(batch: list[Labeled]) -> Tokens:
    """One batch's tokens; the text is ordinary text (a literal "<|endoftext|>" in it is not the special token)."""
    enc = get_tokenizer()
    eot = np.array([EOT], TOKEN_DTYPE)
    parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
    for val, text, last in batch:
        try:
            ids = enc.encode_to_numpy(text, disallowed_special=())
        except UnicodeEncodeError:  # lone surrogates (from JSON escapes): as tiktoken's own encode does
            ids = enc.encode_to_numpy(text.encode("utf-16", "surrogatepass").decode("utf-16", "replace"),
                                      disallowed_special=())
        parts[val].append(ids.astype(TOKEN_DTYPE))
        if last:
            parts[val].append(eot)
    join = lambda a: np.concatenate(a) if a else np.empty(0, TOKEN_DTYPE)  # noqa: E731
    return Tokens(join(parts[False]), join(parts[True]), sum(doc.last for doc in batch))
