"""Corpus preparation: local files or a Hugging Face hub dataset -> flat uint16 token files + meta.json.

    python -m data.prepare --source 'corpus/*.jsonl.gz' --out_dir /data/mine
    python -m data.prepare --source HuggingFaceFW/fineweb --name sample-10BT --out_dir /data/fineweb
    python -m data.prepare --source input.txt --out_dir /data/tiny --val_fraction 0.1     # one document
    python -m data.prepare --source 'big/*.jsonl' --out_dir /shared/x --num_workers 8 --worker_index $i

Three stages, each a stream with bounded memory:

  read      the source is cut into work units (a file, a 128 MiB line-aligned byte range of a large
            uncompressed .jsonl, or a shard of a hub dataset); a unit is read as a stream of documents
            (no `datasets` cache).
  tokenize  batches of ~1 MB of text are encoded by tiktoken on one thread per core; whether a document
            goes to validation is a seeded hash of its position (file, byte offset or row), so the split is
            the same whatever the batch size or number of workers.
  write     each unit's train/val tokens go to part files under `out_dir/.prepare/`, committed by renaming
            a small record into place. A rerun skips committed units (resume after kill -9); worker i of N
            does units i, i+N, ... . When every unit is committed, whoever sees it last concatenates the
            parts in unit order into the final shards and writes meta.json last.

Output (the format nanoGPT and llm.c use): `train.bin` / `val.bin` — little-endian uint16 token ids, each
document followed by <|endoftext|> — split into `train-00000.bin`, ... when larger than `shard_tokens`; and
`meta.json`. The token files are byte-identical whatever the number of workers, threads or interruptions.
"""

from __future__ import annotations

from data.prepare.config import PrepareConfig
from data.prepare.pipeline import prepare
from errors import UserError, fail


def main(argv: list[str] | None = None) -> None:
    """The command line (this module's docstring is its --help); any error ends in one `error:` line."""
    from configs.cli import parse  # tyro: only the command line needs it

    cfg = parse(PrepareConfig, argv, prog="python -m data.prepare", description=__doc__)
    try:
        prepare(cfg)
    except (UserError, OSError) as e:  # OSError: a full disk or an unreadable file, named by the message
        fail(str(e))
