"""The final output: once every unit is committed, one worker joins the parts into the token files.

The parts are concatenated in unit order into shards of `shard_tokens` tokens (so the files are the same
whatever the number of workers), meta.json is written, and everything is moved into out_dir with meta.json
last: a corpus without meta.json is incomplete, whoever looks at it.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
from pathlib import Path

from data.format import META, SPLITS, TOKEN_DTYPE, make_meta, shard_names, token_files
from data.prepare import commit
from data.prepare.config import PrepareConfig
from data.prepare.sources import Unit
from data.tokenizer import VOCAB_SIZE
from errors import DataError

GPT2_WINDOW_TOKENS = 1025  # one GPT-2 window of 1024 tokens + its shifted target: below it, a warning

Range = tuple[Path, int, int]  # (part file, first token, tokens)


def finalize(out: Path, state: Path, cfg: PrepareConfig, units: list[Unit]) -> dict | None:
    """When every unit is committed: the final shards and meta.json, by the one worker that takes the lock.

    Returns the token count of each split, or None when units still run elsewhere or another worker finishes.
    """
    with commit.lock(state / "finalize.lock") as held:
        records = commit.all_records(state, units) if held else None
        if records is None:
            return None
        commit.remove_stale(state, "*.tmp-*")  # every worker is done: any temporary is a killed run's
        streams = split_ranges(state, units, records, cfg)
        counts = {s: sum(n for _, _, n in streams[s]) for s in SPLITS}
        try:
            check_counts(cfg, counts)
        except DataError:
            shutil.rmtree(state, ignore_errors=True)  # so that a rerun with other settings is not refused
            raise
        files = {s: write_shards(state, s, streams[s], counts[s], cfg.shard_tokens) for s in SPLITS}
        max_id = max(r["max_token_id"] for r in records)
        assert max_id < VOCAB_SIZE, max_id
        meta = make_meta(counts=counts, files=files, max_token_id=max_id, source=cfg.settings())
        (state / META).write_text(json.dumps(meta, indent=2))
        publish(state, out, files["train"] + files["val"])
        shutil.rmtree(state, ignore_errors=True)
        return counts


def split_ranges(state: Path, units: list[Unit], records: list[dict], cfg: PrepareConfig) -> dict[str, list[Range]]:
    """Each split as ranges of part files, in unit order.

    A source of one document (nanoGPT's input.txt) is split by tokens: the last val_fraction go to val.
    """
    ranges = {s: [(commit.part_path(state, u, s), 0, r[s]) for u, r in zip(units, records) if r[s]] for s in SPLITS}
    if sum(r["documents"] for r in records) != 1 or cfg.val_split is not None:
        return ranges
    (path, _, n), = ranges["train"] + ranges["val"]
    n_val = max(1, int(n * cfg.val_fraction))
    return {"train": [(path, 0, n - n_val)], "val": [(path, n - n_val, n_val)]}


def check_counts(cfg: PrepareConfig, counts: dict[str, int]) -> None:
    """Refuses a split that holds not even one window (2 tokens: one input and its target). A split shorter
    than a GPT-2 window is only warned about (`short_splits`): training refuses a window it cannot fill,
    naming its train.seq_len, and shorter windows are common (the shakespeare_cpu preset trains on 128)."""
    if counts["train"] + counts["val"] == 0:
        raise DataError(f"{cfg.source}: has no text in field {cfg.text_field!r}")
    for split in SPLITS:
        if counts[split] < 2:
            raise DataError(f"{cfg.source}: the {split} split would have {counts[split]:,} tokens, not one window;"
                            f" {_more(split, counts)}")


def short_splits(counts: dict[str, int]) -> list[str]:
    """A warning for each split shorter than one GPT-2 window of 1024 tokens."""
    return [f"the {split} split has {counts[split]:,} tokens: windows of up to train.seq_len={counts[split] - 1:,}"
            f" (GPT-2's is 1024); for longer ones {_more(split, counts)}"
            for split in SPLITS if counts[split] < GPT2_WINDOW_TOKENS]


def _more(split: str, counts: dict[str, int]) -> str:
    """How to give `split` more tokens."""
    if split == "train":
        return "add text or lower --val_fraction"
    total = counts["train"] + counts["val"]
    fraction = 1.1 * GPT2_WINDOW_TOKENS / max(1, total)
    if fraction > 0.5:
        return f"raise --val_fraction or add text ({total:,} tokens in all)"
    return f"raise --val_fraction (about {fraction:.2g} gives {GPT2_WINDOW_TOKENS:,} tokens)"


def write_shards(directory: Path, split: str, ranges: list[Range], total: int, shard_tokens: int) -> list[str]:
    """Concatenates the ranges into shards of shard_tokens tokens in `directory`; returns their names."""
    queue = collections.deque(ranges)
    names = shard_names(split, max(1, -(-total // shard_tokens)))
    for name in names:
        with open(directory / name, "wb") as dst:
            room = shard_tokens
            while queue and room:
                path, first, n = queue.popleft()
                take = min(n, room)
                _copy(path, dst, first, take)
                if take < n:
                    queue.appendleft((path, first + take, n - take))
                room -= take
    return names


def _copy(path: Path, dst, first: int, tokens: int) -> None:
    """Appends tokens [first, first + tokens) of a part file to dst (in the kernel where it can)."""
    size, offset = TOKEN_DTYPE.itemsize, first * TOKEN_DTYPE.itemsize
    with open(path, "rb") as src:
        left = tokens * size
        while left:
            try:
                copied = os.copy_file_range(src.fileno(), dst.fileno(), left, offset)
            except OSError:  # a filesystem without it: through user space
                src.seek(offset)
                copied = os.write(dst.fileno(), src.read(min(left, 64 << 20)))
            if copied == 0:
                raise DataError(f"{path}: shorter than its record says (truncated?)")
            offset, left = offset + copied, left - copied


def publish(state: Path, out: Path, names: list[str]) -> None:
    """Moves the new files into `out` (meta.json last) and removes token files the new meta does not list."""
    (out / META).unlink(missing_ok=True)  # the corpus is "incomplete" until the new meta lands
    for name in names:
        os.replace(state / name, out / name)
    for p in token_files(out):
        if p.name not in names:
            p.unlink()
    os.replace(state / META, out / META)
