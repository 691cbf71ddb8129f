"""`prepare`: the stages in order for one worker — read, tokenize, commit each unit, then the final shards —
and `prepare_shakespeare`, the embedded default corpus. The only module of data.prepare that prints."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from data.format import META
from data.prepare import commit, shards, sources, tokens
from data.prepare.config import PrepareConfig

SHAKESPEARE = Path(__file__).parents[1] / "assets" / "shakespeare.jsonl.xz"


def prepare(cfg: PrepareConfig, *, quiet: bool = False) -> Path:
    """Prepares this worker's part of the corpus, and the whole when it is the last. Returns `out_dir`.

    Does nothing when `out_dir` already holds a prepared corpus (unless `overwrite`). `quiet`: print nothing.
    """
    out = Path(cfg.out_dir)
    if commit.finished(out, cfg):
        _say(quiet, out, "already prepared (pass --overwrite to redo)")
        return out
    units = sources.plan(cfg)
    with commit.undone_if_refused(out, cfg):
        state = commit.claim(out, cfg, units)
        with commit.worker_lock(state, cfg):
            commit.remove_stale(state, "*" + commit.temporary_suffix(cfg))
            for unit in commit.todo(state, units, cfg):
                _say(quiet, out, f"unit {unit.index + 1}/{len(units)} ({unit.describe()})")
                docs = sources.read(unit, cfg, commit.documents_left(state, units, unit, cfg.max_documents))
                batches = tokens.tokenize(tokens.assign(docs, unit, cfg), cfg.num_threads)
                commit.write_unit(state, unit, batches, cfg)
        counts = shards.finalize(out, state, cfg, units)
    if counts is None:
        _say(quiet, out, f"worker {cfg.worker_index} done; the last worker to finish writes {META}")
    else:
        _say(quiet, out, f"{counts['train']:,} train tokens, {counts['val']:,} val tokens")
        for warning in ([] if quiet else shards.short_splits(counts)):
            print(f"warning: {out}: {warning}", file=sys.stderr, flush=True)
    return out


def prepare_shakespeare(out_dir: str | os.PathLike, *, quiet: bool = False) -> Path:
    """The embedded default: complete Shakespeare (Project Gutenberg), about 10% of the works held out."""
    cfg = PrepareConfig(source=str(SHAKESPEARE), out_dir=str(out_dir), val_fraction=0.1, seed=1)
    return prepare(cfg, quiet=quiet)


def _say(quiet: bool, out: Path, message: str) -> None:
    """A progress line naming the corpus (a pod's workers may print into one log); nothing when quiet."""
    if not quiet:
        print(f"{out}: {message}", flush=True)
