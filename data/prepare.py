"""Corpus preparation: a Hugging Face `datasets` source -> flat uint16 token files + meta.json.

    python -m data.prepare --source openwebtext --out_dir /data/owt --num_proc 32
    python -m data.prepare --source HuggingFaceFW/fineweb --name sample-10BT --streaming --out_dir ...
    python -m data.prepare --source 'corpus/*.jsonl.gz' --text_field text --out_dir /data/mine

Output (the format nanoGPT and llm.c use): `train.bin` / `val.bin` — little-endian uint16 token ids, documents
joined by <|endoftext|> — split into `train-00000.bin`, ... when larger than `shard_tokens`; and `meta.json`.
Everything is written under a temporary directory and renamed into place, `meta.json` last, so a crash never
leaves a half-written corpus that looks complete.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tqdm.auto import tqdm

from data.tokenizer import EOT, RANKS_SHA256, TOKENIZER_NAME, VOCAB_SIZE, get_tokenizer

TOKEN_DTYPE = np.dtype("<u2")  # GPT-2's 50257 ids fit in uint16
META = "meta.json"
SHAKESPEARE = Path(__file__).parent / "assets" / "shakespeare.jsonl.xz"


class DataError(ValueError):
    """Bad or missing data; the message names the path and the problem."""


@dataclasses.dataclass(frozen=True)
class PrepareConfig:
    """Tokenize a `datasets` source into token files.

    Attributes:
      source: a hub dataset name ("openwebtext", "HuggingFaceFW/fineweb") or local files / a glob
        (.txt, .json, .jsonl, .parquet; .gz/.xz/.zst compressed ok).
      out_dir: where train*.bin, val*.bin and meta.json go.
      name: the hub dataset's configuration (e.g. "sample-10BT").
      split: the split to tokenize for training.
      val_split: a named validation split; when None, `val_fraction` of the documents are held out.
      val_fraction: fraction of documents held out for validation (ignored with `val_split`).
      text_field: the column that holds the text.
      num_proc: tokenizer processes (`datasets.map`); ignored when streaming.
      streaming: stream from the hub instead of downloading the whole set first.
      max_documents: stop after this many documents (streaming: also the validation set's source).
      shard_tokens: tokens per .bin file before a new one is started.
      seed: seed of the train/validation document split.
      overwrite: replace an existing prepared corpus (otherwise re-running is a no-op).
    """

    source: str
    out_dir: str
    name: str | None = None
    split: str = "train"
    val_split: str | None = None
    val_fraction: float = 0.0005
    text_field: str = "text"
    num_proc: int = 1
    streaming: bool = False
    max_documents: int | None = None
    shard_tokens: int = 1 << 30
    seed: int = 2357
    overwrite: bool = False


def prepare(cfg: PrepareConfig, *, quiet: bool = False) -> Path:
    """Prepares the corpus (or does nothing when `out_dir` already holds one). Returns `out_dir`."""
    out = Path(cfg.out_dir)
    if (out / META).exists() and not cfg.overwrite:
        if not quiet:
            print(f"{out}: already prepared (pass --overwrite to redo)")
        return out
    if not 0.0 < cfg.val_fraction < 1.0 and cfg.val_split is None:
        raise DataError(f"val_fraction must be in (0, 1), got {cfg.val_fraction}")
    train, val = _load(cfg)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".tmp-prepare-") as tmp:
        tmp = Path(tmp)
        counts, files = {}, {}
        for split, docs in (("train", train), ("val", val)):
            tokens = _tokenize(docs, cfg, desc=f"tokenizing {split}", quiet=quiet)
            counts[split], files[split], max_id = _write(tokens, tmp, split, cfg.shard_tokens)
            if counts[split] == 0:
                raise DataError(f"{cfg.source}: the {split} split has no text in field {cfg.text_field!r}")
            assert max_id < VOCAB_SIZE, max_id
        meta = {
            "tokenizer": TOKENIZER_NAME, "tokenizer_sha256": RANKS_SHA256, "vocab_size": VOCAB_SIZE,
            "eot": EOT, "dtype": "uint16",
            "train_tokens": counts["train"], "val_tokens": counts["val"],
            "train_files": files["train"], "val_files": files["val"],
            "source": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("out_dir", "overwrite")},
        }
        (tmp / META).write_text(json.dumps(meta, indent=2))
        _publish(tmp, out, files["train"] + files["val"])
    if not quiet:
        print(f"{out}: {counts['train']:,} train tokens, {counts['val']:,} val tokens")
    return out


def prepare_shakespeare(out_dir: str | os.PathLike, *, quiet: bool = False) -> Path:
    """The embedded default: complete Shakespeare (Project Gutenberg), 10% of the works held out."""
    cfg = PrepareConfig(source=str(SHAKESPEARE), out_dir=str(out_dir), val_fraction=0.1, seed=1)
    return prepare(cfg, quiet=quiet)


# ---- reading -----------------------------------------------------------------------------------

BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
COMPRESSED = (".gz", ".xz", ".zst", ".bz2")


def _local_files(source: str) -> list[str] | None:
    """Local files named by `source` (a path, a directory or a glob); None when it is a hub name."""
    if any(ch in source for ch in "*?["):
        files = sorted(glob.glob(source, recursive=True))
        if not files:
            raise DataError(f"{source}: no files match")
        return files
    path = Path(source)
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob("*") if p.is_file() and _builder(str(p)))
        if not files:
            raise DataError(f"{source}: no .txt/.json/.jsonl/.parquet files in this directory")
        return files
    if path.is_file():
        return [str(path)]
    if source.startswith((".", "/", "~")) or _builder(source):  # meant a local file, not a hub name
        raise DataError(f"{source}: no such file or directory")
    return None


def _builder(path: str) -> str | None:
    name = path
    for ext in COMPRESSED:
        name = name.removesuffix(ext)
    return BUILDERS.get(Path(name).suffix)


def _load(cfg: PrepareConfig):
    """(train, val) datasets (or iterables of documents, when streaming)."""
    import datasets

    files = _local_files(cfg.source)
    if files is not None:
        builders = {_builder(f) for f in files}
        if None in builders or len(builders) != 1:
            raise DataError(f"{cfg.source}: expected files of one kind among {sorted(BUILDERS)}")
        builder = builders.pop()
        kw = {"sample_by": "document"} if builder == "text" else {}
        ds = datasets.load_dataset(builder, data_files=files, split="train", **kw)
    else:
        ds = datasets.load_dataset(cfg.source, cfg.name, split=cfg.split, streaming=cfg.streaming)
    if cfg.max_documents is not None:
        ds = ds.take(cfg.max_documents)
    columns = ds.column_names
    if columns is not None and cfg.text_field not in columns:
        raise DataError(f"{cfg.source}: no text field {cfg.text_field!r}; fields are {columns}")
    if cfg.val_split is not None:
        val = datasets.load_dataset(cfg.source, cfg.name, split=cfg.val_split, streaming=cfg.streaming)
        return ds, val
    if cfg.streaming:
        # an unbounded stream cannot be split by fraction: hold out the first documents instead
        n_val = max(1, int(cfg.val_fraction * (cfg.max_documents or 1_000_000)))
        return ds.skip(n_val), ds.take(n_val)
    if len(ds) < 2:
        raise DataError(f"{cfg.source}: need at least 2 documents to hold some out, found {len(ds)}")
    split = ds.train_test_split(test_size=max(cfg.val_fraction, 1 / len(ds)), seed=cfg.seed)
    return split["train"], split["test"]


def _tokenize(ds, cfg: PrepareConfig, *, desc: str, quiet: bool) -> Iterator[np.ndarray]:
    """Token arrays, one per batch of documents, each document followed by <|endoftext|>."""
    enc = get_tokenizer()
    field = cfg.text_field

    def encode(batch):
        ids = enc.encode_ordinary_batch(batch[field])  # empty documents are dropped, not kept as a bare EOT
        return {"ids": [np.asarray(x + [EOT], dtype=TOKEN_DTYPE) for x in ids if x]}

    import datasets

    if isinstance(ds, datasets.Dataset):
        ds = ds.map(encode, batched=True, remove_columns=ds.column_names, num_proc=max(1, cfg.num_proc),
                    desc=desc)
        for batch in ds.with_format("numpy").iter(batch_size=1024):
            yield np.concatenate(batch["ids"]) if len(batch["ids"]) else np.empty(0, TOKEN_DTYPE)
        return
    for batch in tqdm(ds.iter(batch_size=256), desc=desc, unit=" batches", disable=quiet):
        yield from encode(batch)["ids"]


# ---- writing -----------------------------------------------------------------------------------


def _write(chunks: Iterable[np.ndarray], tmp: Path, split: str, shard_tokens: int):
    """Writes token chunks into tmp/{split}-NNNNN.bin files. Returns (tokens, file names, max id)."""
    names, total, max_id = [], 0, 0
    f, in_shard = None, 0
    for chunk in chunks:
        max_id = max(max_id, int(chunk.max(initial=0)))
        while chunk.size:
            if f is None or in_shard == shard_tokens:
                if f is not None:
                    f.close()
                names.append(f"{split}-{len(names):05d}.bin")
                f, in_shard = open(tmp / names[-1], "wb"), 0
            part, chunk = chunk[: shard_tokens - in_shard], chunk[shard_tokens - in_shard:]
            f.write(part.astype(TOKEN_DTYPE, copy=False).tobytes())
            in_shard += part.size
            total += part.size
    if f is not None:
        f.close()
    if len(names) == 1:  # a single file gets nanoGPT's plain name
        os.replace(tmp / names[0], tmp / f"{split}.bin")
        names = [f"{split}.bin"]
    return total, names, max_id


def _publish(tmp: Path, out: Path, names: list[str]) -> None:
    """Moves the new files into `out` (meta.json last) and removes token files the new meta does not list."""
    old = json.loads((out / META).read_text()) if (out / META).exists() else {}
    (out / META).unlink(missing_ok=True)  # the corpus is "incomplete" until the new meta lands
    for name in names:
        os.replace(tmp / name, out / name)
    for name in old.get("train_files", []) + old.get("val_files", []):
        if name not in names:
            (out / name).unlink(missing_ok=True)
    os.replace(tmp / META, out / META)


def main(argv: list[str] | None = None) -> None:
    from configs.cli import parse

    cfg = parse(PrepareConfig, argv, prog="python -m data.prepare")
    try:
        prepare(cfg)
    except (DataError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}")


if __name__ == "__main__":
    main()
