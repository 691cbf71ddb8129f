"""The read stage: a source cut into work units, and each unit read as a stream of documents.

A source is local files (text, JSON lines or parquet, compressed or not) or a Hugging Face hub dataset, which
is streamed shard by shard (nothing goes to the `datasets` cache). A work unit is a file, a line-aligned byte
range of a large uncompressed .jsonl, or a hub shard: what one worker reads in one go and commits at once.
"""

from __future__ import annotations

import bz2
import dataclasses
import glob
import gzip
import io
import json
import lzma
import os
from pathlib import Path
from typing import Iterator, NamedTuple

from data.prepare.config import PrepareConfig
from errors import DataError, first_line

FORMATS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
COMPRESSED = (".gz", ".xz", ".bz2", ".zst")
UNIT_BYTES = 128 << 20  # an uncompressed .jsonl larger than this is cut into line-aligned byte ranges
PIECE_CHARS = 1 << 20  # a .txt document is handed on in pieces of about this much text


@dataclasses.dataclass(frozen=True)
class Unit:
    """A piece of the source one worker reads in one go: a file, a byte range of one, or a hub shard."""

    index: int
    kind: str  # "text", "json", "parquet" or "hub"
    path: str  # the file, or the hub split
    file_no: int = 0  # position of the file among the source's files (hub: the shard)
    start: int = 0  # byte range [start, end) of an uncompressed .jsonl; lines starting in it are its own
    end: int | None = None
    all_val: bool = False  # a named validation split

    def describe(self) -> str:
        return f"{self.path} bytes {self.start}-{self.end}" if self.end is not None else self.path


class Document(NamedTuple):
    """A document, or a piece of one (a large .txt is handed on in pieces that tokenize like the whole)."""

    position: int  # byte offset or row in its unit's file: with the unit's file_no, it names the document
    text: str
    last: bool  # the document's last piece (always True but for .txt pieces)


# ---- planning ------------------------------------------------------------------------------------


def plan(cfg: PrepareConfig) -> list[Unit]:
    """The source's work units, in source order (the same for every worker)."""
    files = local_files(cfg.source)
    if files is None:
        return _hub_units(cfg)
    if cfg.val_split is not None:
        raise DataError(f"{cfg.source}: --val_split names a hub split; local files use --val_fraction")
    kinds = {file_format(f) for f in files}
    if None in kinds or len(kinds) != 1:
        raise DataError(f"{cfg.source}: expected files of one kind among {sorted(FORMATS)}")
    kind = kinds.pop()
    units = []
    for file_no, f in enumerate(files):
        size = os.path.getsize(f)
        if kind == "parquet" and f.endswith(COMPRESSED):
            raise DataError(f"{f}: parquet is compressed inside; give the .parquet file itself")
        if kind == "json" and not f.endswith(COMPRESSED) and size > UNIT_BYTES:
            for start in range(0, size, UNIT_BYTES):
                units.append(Unit(len(units), kind, f, file_no, start, min(start + UNIT_BYTES, size)))
        else:
            units.append(Unit(len(units), kind, f, file_no))
    return units


def local_files(source: str) -> list[str] | None:
    """Local files named by `source` (a path, a directory or a glob); None when it is a hub name."""
    if any(ch in source for ch in "*?["):
        files = sorted(glob.glob(source, recursive=True))
        if not files:
            raise DataError(f"{source}: no files match")
        return files
    path = Path(source)
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob("*") if p.is_file() and file_format(str(p)))
        if not files:
            raise DataError(f"{source}: no .txt/.json/.jsonl/.parquet files in this directory")
        return files
    if path.is_file():
        return [str(path)]
    if source.startswith((".", "/", "~")) or file_format(source):  # meant a local file, not a hub name
        raise DataError(f"{source}: no such file or directory")
    return None


def file_format(path: str) -> str | None:
    """"text", "json" or "parquet" by the name's ending (under any compression's); None for another."""
    name = path
    for ext in COMPRESSED:
        name = name.removesuffix(ext)
    return FORMATS.get(Path(name).suffix)


def _hub_units(cfg: PrepareConfig) -> list[Unit]:
    """One unit per shard (data file) of the hub split, then of the named validation split."""
    units = []
    for split, all_val in ((cfg.split, False), (cfg.val_split, True)):
        if split is not None:
            ds = _hub_stream(cfg, split)
            if ds.column_names is not None and cfg.text_field not in ds.column_names:
                raise DataError(f"{cfg.source}: no text field {cfg.text_field!r}; fields are {ds.column_names}")
            units += [Unit(len(units) + k, "hub", split, k, all_val=all_val) for k in range(ds.n_shards)]
    return units


def _hub_stream(cfg: PrepareConfig, split: str):
    import datasets  # only for hub sources: it is slow to import

    try:
        return datasets.load_dataset(cfg.source, cfg.name, split=split, streaming=True)
    except (FileNotFoundError, ValueError, datasets.exceptions.DatasetNotFoundError) as e:
        raise DataError(f"{cfg.source}: {first_line(e)}") from None


# ---- reading -------------------------------------------------------------------------------------


def read(unit: Unit, cfg: PrepareConfig, max_documents: int | None = None) -> Iterator[Document]:
    """The unit's documents in order, empty ones skipped; at most `max_documents` whole documents."""
    readers = {"json": _read_jsonl, "text": _read_text, "parquet": _read_parquet, "hub": _read_hub}
    docs = readers[unit.kind](unit, cfg)
    if max_documents is None:
        yield from docs
        return
    for doc in docs:
        if max_documents <= 0:
            return
        yield doc
        max_documents -= doc.last


def open_file(path: str) -> io.BufferedIOBase:
    """A local file's bytes, decompressed as its name's ending says (.gz, .xz, .bz2, .zst)."""
    if path.endswith(".zst"):
        try:
            import zstandard  # an optional dependency
        except ImportError:
            raise DataError(f"{path}: reading .zst needs `pip install zstandard`") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    for ext, module in ((".gz", gzip), (".xz", lzma), (".bz2", bz2)):
        if path.endswith(ext):
            return module.open(path, "rb")
    return open(path, "rb")


def _decode(line: bytes, path: str, offset: int, errors: str) -> str:
    try:
        return line.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: invalid UTF-8 at byte {offset + e.start} (pass --errors replace to accept it)")


def _read_jsonl(unit: Unit, cfg: PrepareConfig) -> Iterator[Document]:
    """JSON lines; a byte-range unit owns the lines that start inside its range."""
    with open_file(unit.path) as f:
        pos = unit.start
        if pos:
            f.seek(pos - 1)
            pos += len(f.readline()) - 1  # the rest of a line that started before the range
        for line_no, line in enumerate(f, 1):
            if unit.end is not None and pos >= unit.end:
                return
            where = f"line {line_no}" if unit.start == 0 else f"the line at byte {pos}"
            if not line.isspace():
                text = _json_text(_decode(line, unit.path, pos, cfg.errors), cfg.text_field, f"{unit.path}: {where}")
                if text:
                    yield Document(pos, text, True)
            pos += len(line)


def _json_text(line: str, field: str, where: str) -> str:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg})") from None
    if isinstance(row, list):
        raise DataError(f"{where}: a JSON array; expected JSON lines (one object per line)")
    if not isinstance(row, dict) or field not in row:
        fields = sorted(row) if isinstance(row, dict) else []
        raise DataError(f"{where}: no text field {field!r}; fields are {fields} (choose one with --text_field)")
    text = row[field]
    if not isinstance(text, str):
        raise DataError(f"{where}: text field {field!r} is {'null' if text is None else type(text).__name__}")
    return text


def _read_text(unit: Unit, cfg: PrepareConfig) -> Iterator[Document]:
    """A .txt file as one document, in pieces of ~PIECE_CHARS cut where tokenization cannot cross.

    GPT-2's pre-tokenizer regex never joins a single "\\n" that follows a non-space character to the non-space
    character after it, so cutting there gives the tokens of the whole text (tested).
    """
    piece: list[str] = []
    size, pos = 0, 0
    with open_file(unit.path) as f:
        for line in f:
            text = _decode(line, unit.path, pos, cfg.errors)
            pos += len(line)
            if size >= PIECE_CHARS and _cuttable(piece[-1], text):
                yield Document(0, "".join(piece), False)
                piece, size = [], 0
            piece.append(text)
            size += len(text)
    if piece:
        yield Document(0, "".join(piece), True)


def _cuttable(before: str, after: str) -> bool:
    return len(before) >= 2 and before[-1] == "\n" and not before[-2].isspace() and not after[:1].isspace()


def _read_parquet(unit: Unit, cfg: PrepareConfig) -> Iterator[Document]:
    import pyarrow.parquet as pq  # only for parquet sources

    pf = pq.ParquetFile(unit.path)
    if cfg.text_field not in pf.schema_arrow.names:
        raise DataError(f"{unit.path}: no text field {cfg.text_field!r}; fields are {pf.schema_arrow.names}")
    row = 0
    for batch in pf.iter_batches(batch_size=1024, columns=[cfg.text_field]):
        for text in batch.column(0).to_pylist():
            if text is None:
                raise DataError(f"{unit.path}: row {row + 1}: text field {cfg.text_field!r} is null")
            if text:
                yield Document(row, text, True)
            row += 1


def _read_hub(unit: Unit, cfg: PrepareConfig) -> Iterator[Document]:
    ds = _hub_stream(cfg, unit.path)
    for row, example in enumerate(ds.shard(num_shards=ds.n_shards, index=unit.file_no)):
        text = example.get(cfg.text_field)
        if not isinstance(text, str):
            what = "missing" if cfg.text_field not in example else "null" if text is None else type(text).__name__
            raise DataError(f"{cfg.source}: {unit.path} shard {unit.file_no} row {row + 1}: text field"
                            f" {cfg.text_field!r} is {what}")
        if text:
            yield Document(row, text, True)
