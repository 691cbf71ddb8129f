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

import collections
import contextlib
import dataclasses
import fcntl
import glob
import hashlib
import io
import json
import math
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Iterator, Literal

import numpy as np

from configs.errors import DataError  # also public here: callers import it from data.prepare
from data.tokenizer import EOT, RANKS_SHA256, TOKENIZER_NAME, VOCAB_SIZE, get_tokenizer

TOKEN_DTYPE = np.dtype("<u2")  # GPT-2's 50257 ids fit in uint16
META = "meta.json"
STATE = ".prepare"  # work area under out_dir: settings, unit parts and their records; gone when done
SHAKESPEARE = Path(__file__).parent / "assets" / "shakespeare.jsonl.xz"
MIN_SPLIT_TOKENS = 1025  # one GPT-2 window of 1024 tokens + its shifted target
MIN_SHARD_TOKENS = 1 << 16
UNIT_BYTES = 128 << 20  # an uncompressed .jsonl larger than this is cut into line-aligned byte ranges
BATCH_CHARS = 1 << 20  # text per tokenizer task


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
                            " (README, Run directories on cloud storage)")
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


def prepare(cfg: PrepareConfig, *, quiet: bool = False) -> Path:
    """Prepares this worker's part of the corpus, and the whole when it is the last. Returns `out_dir`.

    Does nothing when `out_dir` already holds a prepared corpus (unless `overwrite`).
    """
    out = Path(cfg.out_dir)
    if _finished(out, cfg, quiet):
        return out
    units = _plan(cfg)
    state = _claim(out, cfg, units)
    with _lock(state / f"worker-{cfg.worker_index}-of-{cfg.num_workers}.lock") as held:
        if not held:
            raise DataError(f"{out}: worker {cfg.worker_index} of {cfg.num_workers} is already running")
        _remove_stale(state, f"*.tmp-w{cfg.worker_index}of{cfg.num_workers}")
        todo = [u for u in units[cfg.worker_index :: cfg.num_workers] if not _record_path(state, u).exists()]
        for unit in todo:
            _say(quiet, f"{out}: unit {unit.index + 1}/{len(units)} ({unit.describe()})")
            budget = _documents_left(state, units, unit, cfg.max_documents)
            docs = _assign(_read(unit, cfg, budget), unit, cfg)
            _write_unit(state, unit, _tokenize(docs, cfg), cfg)
    counts = _finalize(out, state, cfg, units)
    if counts is None:
        _say(quiet, f"{out}: worker {cfg.worker_index} done; the last worker to finish writes {META}")
    else:
        _say(quiet, f"{out}: {counts['train']:,} train tokens, {counts['val']:,} val tokens")
    return out


def prepare_shakespeare(out_dir: str | os.PathLike, *, quiet: bool = False) -> Path:
    """The embedded default: complete Shakespeare (Project Gutenberg), about 10% of the works held out."""
    cfg = PrepareConfig(source=str(SHAKESPEARE), out_dir=str(out_dir), val_fraction=0.1, seed=1)
    return prepare(cfg, quiet=quiet)


def _say(quiet: bool, message: str) -> None:
    if not quiet:
        print(message, flush=True)


# ---- read: work units and their documents -------------------------------------------------------

FORMATS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
COMPRESSED = (".gz", ".xz", ".bz2", ".zst")


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


def _plan(cfg: PrepareConfig) -> list[Unit]:
    """The source's work units, in source order (the same for every worker)."""
    files = _local_files(cfg.source)
    if files is None:
        return _hub_units(cfg)
    if cfg.val_split is not None:
        raise DataError(f"{cfg.source}: --val_split names a hub split; local files use --val_fraction")
    kinds = {_format(f) for f in files}
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


def _local_files(source: str) -> list[str] | None:
    """Local files named by `source` (a path, a directory or a glob); None when it is a hub name."""
    if any(ch in source for ch in "*?["):
        files = sorted(glob.glob(source, recursive=True))
        if not files:
            raise DataError(f"{source}: no files match")
        return files
    path = Path(source)
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob("*") if p.is_file() and _format(str(p)))
        if not files:
            raise DataError(f"{source}: no .txt/.json/.jsonl/.parquet files in this directory")
        return files
    if path.is_file():
        return [str(path)]
    if source.startswith((".", "/", "~")) or _format(source):  # meant a local file, not a hub name
        raise DataError(f"{source}: no such file or directory")
    return None


def _format(path: str) -> str | None:
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
    import datasets

    try:
        return datasets.load_dataset(cfg.source, cfg.name, split=split, streaming=True)
    except (FileNotFoundError, ValueError, datasets.exceptions.DatasetNotFoundError) as e:
        raise DataError(f"{cfg.source}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def _read(unit: Unit, cfg: PrepareConfig, max_documents: int | None = None) -> Iterator[tuple[int, str, bool]]:
    """The unit's documents as (position, text, last piece of the document); empty documents skipped.

    position (byte offset or row) and the unit's file_no identify a document for the validation hash.
    """
    readers = {"json": _read_jsonl, "text": _read_text, "parquet": _read_parquet, "hub": _read_hub}
    docs = readers[unit.kind](unit, cfg)
    if max_documents is None:
        yield from docs
        return
    for item in docs:
        if max_documents <= 0:
            return
        yield item
        max_documents -= item[2]


def _open(path: str) -> io.BufferedIOBase:
    if path.endswith(".gz"):
        import gzip

        return gzip.open(path, "rb")
    if path.endswith(".xz"):
        import lzma

        return lzma.open(path, "rb")
    if path.endswith(".bz2"):
        import bz2

        return bz2.open(path, "rb")
    if path.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise DataError(f"{path}: reading .zst needs `pip install zstandard`") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def _decode(line: bytes, path: str, offset: int, errors: str) -> str:
    try:
        return line.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: invalid UTF-8 at byte {offset + e.start} (pass --errors replace to accept it)")


def _read_jsonl(unit: Unit, cfg: PrepareConfig) -> Iterator[tuple[int, str, bool]]:
    """JSON lines; a byte-range unit owns the lines that start inside its range."""
    field = cfg.text_field
    with _open(unit.path) as f:
        pos = unit.start
        if pos:
            f.seek(pos - 1)
            pos += len(f.readline()) - 1  # the rest of a line that started before the range
        for line_no, line in enumerate(f, 1):
            if unit.end is not None and pos >= unit.end:
                return
            where = f"line {line_no}" if unit.start == 0 else f"the line at byte {pos}"
            if not line.isspace():
                text = _json_text(_decode(line, unit.path, pos, cfg.errors), field, f"{unit.path}: {where}")
                if text:
                    yield pos, text, True
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


def _read_text(unit: Unit, cfg: PrepareConfig) -> Iterator[tuple[int, str, bool]]:
    """A .txt file as one document, in pieces of ~1 MB cut where tokenization cannot cross.

    GPT-2's pre-tokenizer regex never joins a single "\\n" that follows a non-space character to the non-space
    character after it, so cutting there gives the tokens of the whole text (tested).
    """
    piece: list[str] = []
    size, pos = 0, 0
    with _open(unit.path) as f:
        for line in f:
            text = _decode(line, unit.path, pos, cfg.errors)
            pos += len(line)
            if size >= BATCH_CHARS and _cuttable(piece[-1], text):
                yield 0, "".join(piece), False
                piece, size = [], 0
            piece.append(text)
            size += len(text)
    if piece:
        yield 0, "".join(piece), True


def _cuttable(before: str, after: str) -> bool:
    return len(before) >= 2 and before[-1] == "\n" and not before[-2].isspace() and not after[:1].isspace()


def _read_parquet(unit: Unit, cfg: PrepareConfig) -> Iterator[tuple[int, str, bool]]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(unit.path)
    if cfg.text_field not in pf.schema_arrow.names:
        raise DataError(f"{unit.path}: no text field {cfg.text_field!r}; fields are {pf.schema_arrow.names}")
    row = 0
    for batch in pf.iter_batches(batch_size=1024, columns=[cfg.text_field]):
        for text in batch.column(0).to_pylist():
            if text is None:
                raise DataError(f"{unit.path}: row {row + 1}: text field {cfg.text_field!r} is null")
            if text:
                yield row, text, True
            row += 1


def _read_hub(unit: Unit, cfg: PrepareConfig) -> Iterator[tuple[int, str, bool]]:
    ds = _hub_stream(cfg, unit.path)
    for row, example in enumerate(ds.shard(num_shards=ds.n_shards, index=unit.file_no)):
        text = example.get(cfg.text_field)
        if not isinstance(text, str):
            what = "missing" if cfg.text_field not in example else "null" if text is None else type(text).__name__
            raise DataError(f"{cfg.source}: {unit.path} shard {unit.file_no} row {row + 1}: text field"
                            f" {cfg.text_field!r} is {what}")
        if text:
            yield row, text, True


# ---- tokenize: threaded tiktoken, the validation split ------------------------------------------


@dataclasses.dataclass
class Tokens:
    """One batch's tokens, each document followed by <|endoftext|>."""

    train: np.ndarray
    val: np.ndarray
    documents: int  # documents that ended in this batch


def is_val(seed: int, file_no: int, position: int, fraction: float) -> bool:
    """Whether a document goes to validation: a seeded hash of where it is, uniform in [0, 1)."""
    digest = hashlib.blake2b(f"{seed}:{file_no}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


def _assign(docs: Iterable[tuple[int, str, bool]], unit: Unit, cfg: PrepareConfig) -> Iterator[tuple[bool, str, bool]]:
    """(goes to validation, text, last piece) for the unit's documents."""
    for position, text, last in docs:
        val = unit.all_val if cfg.val_split is not None else is_val(cfg.seed, unit.file_no, position,
                                                                     cfg.val_fraction)
        yield val, text, last


def _tokenize(docs: Iterable[tuple[bool, str, bool]], cfg: PrepareConfig) -> Iterator[Tokens]:
    """Tokens per batch of ~1 MB of text, in order; the next batches are read while threads encode."""
    threads = cfg.num_threads or len(os.sched_getaffinity(0))
    with ThreadPoolExecutor(threads) as pool:
        pending: collections.deque = collections.deque()
        for batch in _batches(docs):
            pending.append(pool.submit(_encode, batch))
            if len(pending) > 2 * threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _batches(docs: Iterable[tuple[bool, str, bool]]) -> Iterator[list[tuple[bool, str, bool]]]:
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += len(doc[1])
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encode(batch: list[tuple[bool, str, bool]]) -> Tokens:
    enc = get_tokenizer()
    eot = np.array([EOT], TOKEN_DTYPE)
    parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
    for val, text, last in batch:
        try:
            ids = enc.encode_to_numpy(text, disallowed_special=())  # ordinary text, no special tokens
        except UnicodeEncodeError:  # lone surrogates (from JSON escapes): as tiktoken's own encode does
            ids = enc.encode_to_numpy(text.encode("utf-16", "surrogatepass").decode("utf-16", "replace"),
                                      disallowed_special=())
        parts[val].append(ids.astype(TOKEN_DTYPE))
        if last:
            parts[val].append(eot)
    join = lambda a: np.concatenate(a) if a else np.empty(0, TOKEN_DTYPE)  # noqa: E731
    return Tokens(join(parts[False]), join(parts[True]), sum(last for _, _, last in batch))


# ---- write: unit parts, resume, workers, the final shards ---------------------------------------


def _finished(out: Path, cfg: PrepareConfig, quiet: bool) -> bool:
    """True when out_dir holds a corpus this program prepared and we are not asked to redo it."""
    meta = _our_meta(out)
    if meta is not None and not cfg.overwrite and not (out / STATE).exists():
        _say(quiet, f"{out}: already prepared (pass --overwrite to redo)")
        return True
    if (out / META).exists() and meta is None and not cfg.overwrite:
        raise DataError(f"{out / META}: not written by data.prepare (pass --overwrite to replace it)")
    return False


def _our_meta(out: Path) -> dict | None:
    try:
        meta = json.loads((out / META).read_text())
    except (OSError, ValueError):
        return None
    keys = {"tokenizer_sha256", "train_files", "val_files", "source"}
    return meta if isinstance(meta, dict) and keys <= meta.keys() else None


def _claim(out: Path, cfg: PrepareConfig, units: list[Unit]) -> Path:
    """The work area for these settings: a partial run's with the same settings, or a new one."""
    state, settings = out / STATE, _settings(cfg, units)
    old = _read_json(state / "settings.json")
    if old is not None and old != settings:
        if not cfg.overwrite and any(state.glob("unit-*.json")):  # (with none committed there is nothing to keep)
            differ = sorted(k for k in settings.keys() | old.keys() if settings.get(k) != old.get(k))
            raise DataError(f"{out}: holds a partial run with other settings ({', '.join(differ)});"
                            " rerun it as it was, or pass --overwrite to start over")
        shutil.rmtree(state)
    if old is None and not cfg.overwrite:
        meta = _our_meta(out) or {"train_files": [], "val_files": []}
        ours = set(meta["train_files"] + meta["val_files"])
        foreign = sorted(p.name for p in _token_files(out) if p.name not in ours)
        if foreign:
            raise DataError(f"{out}: holds {', '.join(foreign)} not written by data.prepare"
                            " (pass --overwrite to replace them)")
    for stale in out.glob(".tmp-prepare-*"):  # an earlier version's temporary directories
        shutil.rmtree(stale, ignore_errors=True)
    state.mkdir(parents=True, exist_ok=True)
    tmp = state / f"settings.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(settings))
    with contextlib.suppress(FileExistsError):
        os.link(tmp, state / "settings.json")  # first writer wins; the others checked equality above
    tmp.unlink()
    return state


def _settings(cfg: PrepareConfig, units: list[Unit]) -> dict:
    """What a partial run's parts depend on: the config, the units and the source files' sizes."""
    sizes = {u.path: os.path.getsize(u.path) for u in units if u.kind != "hub"}
    settings = {**cfg.settings(), "units": [dataclasses.astuple(u) for u in units], "file_sizes": sizes}
    return json.loads(json.dumps(settings))  # tuples -> lists, as read back


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _token_files(out: Path) -> list[Path]:
    """Files in out_dir with the names this program gives token files."""
    return sorted(p for p in out.glob("*.bin") if re.fullmatch(r"(train|val)(-\d{5})?\.bin", p.name))


@contextlib.contextmanager
def _lock(path: Path):
    """An exclusive advisory lock (flock), released when the process dies; yields whether it is held."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR)
    except FileNotFoundError:  # the work area is gone: another worker finished
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _remove_stale(state: Path, pattern: str) -> None:
    """Temporary files left by a killed run of a worker whose lock we now hold."""
    for p in state.glob(pattern):
        p.unlink(missing_ok=True)


def _record_path(state: Path, unit: Unit) -> Path:
    return state / f"unit-{unit.index:05d}.json"


def _part(state: Path, unit: Unit, split: str) -> Path:
    return state / f"unit-{unit.index:05d}.{split}.bin"


def _documents_left(state: Path, units: list[Unit], unit: Unit, max_documents: int | None) -> int | None:
    """max_documents minus the documents of the units before this one (one worker does them in order)."""
    if max_documents is None:
        return None
    return max_documents - sum(_read_json(_record_path(state, u))["documents"] for u in units[: unit.index])


def _write_unit(state: Path, unit: Unit, batches: Iterable[Tokens], cfg: PrepareConfig) -> None:
    """Writes the unit's train/val parts and commits them by renaming its record into place."""
    suffix = f".tmp-w{cfg.worker_index}of{cfg.num_workers}"
    record = {"train": 0, "val": 0, "documents": 0, "max_token_id": 0}
    paths = {s: _part(state, unit, s) for s in ("train", "val")}
    with open(str(paths["train"]) + suffix, "wb") as ftrain, open(str(paths["val"]) + suffix, "wb") as fval:
        for tokens in batches:
            for split, f, ids in (("train", ftrain, tokens.train), ("val", fval, tokens.val)):
                f.write(ids.tobytes())
                record[split] += ids.size
                record["max_token_id"] = max(record["max_token_id"], int(ids.max(initial=0)))
            record["documents"] += tokens.documents
    for p in paths.values():
        os.replace(str(p) + suffix, p)
    tmp = Path(str(_record_path(state, unit)) + suffix)
    tmp.write_text(json.dumps(record))
    os.replace(tmp, _record_path(state, unit))


def _finalize(out: Path, state: Path, cfg: PrepareConfig, units: list[Unit]) -> dict | None:
    """When every unit is committed: the final shards and meta.json (by one worker). Returns the counts."""
    with _lock(state / "finalize.lock") as held:
        records = [_read_json(_record_path(state, u)) for u in units] if held else [None]
        if None in records:
            return None  # units still running elsewhere, or another worker is finishing
        _remove_stale(state, "*.tmp-*")
        streams = _split_streams(state, units, records, cfg)
        counts = {s: sum(n for _, _, n in streams[s]) for s in streams}
        try:
            _check_counts(cfg, counts)
        except DataError:
            shutil.rmtree(state, ignore_errors=True)  # so that a rerun with other settings is not refused
            raise
        files = {s: _write_shards(state, s, streams[s], counts[s], cfg.shard_tokens) for s in streams}
        meta = {
            "tokenizer": TOKENIZER_NAME, "tokenizer_sha256": RANKS_SHA256, "vocab_size": VOCAB_SIZE,
            "eot": EOT, "dtype": "uint16", "train_tokens": counts["train"], "val_tokens": counts["val"],
            "train_files": files["train"], "val_files": files["val"],
            "max_token_id": max(r["max_token_id"] for r in records), "source": cfg.settings(),
        }
        assert meta["max_token_id"] < VOCAB_SIZE, meta["max_token_id"]
        (state / META).write_text(json.dumps(meta, indent=2))
        _publish(state, out, files["train"] + files["val"])
        shutil.rmtree(state, ignore_errors=True)
        return counts


def _split_streams(state: Path, units: list[Unit], records: list[dict], cfg: PrepareConfig) -> dict[str, list]:
    """Each split as (part file, first token, tokens) ranges in unit order.

    A source of one document (nanoGPT's input.txt) is split by tokens: the last val_fraction go to val.
    """
    ranges = {s: [(_part(state, u, s), 0, r[s]) for u, r in zip(units, records) if r[s]] for s in ("train", "val")}
    if sum(r["documents"] for r in records) != 1 or cfg.val_split is not None:
        return ranges
    (path, _, n), = ranges["train"] + ranges["val"]
    n_val = max(1, int(n * cfg.val_fraction))
    return {"train": [(path, 0, n - n_val)], "val": [(path, n - n_val, n_val)]}


def _check_counts(cfg: PrepareConfig, counts: dict) -> None:
    if counts["train"] + counts["val"] == 0:
        raise DataError(f"{cfg.source}: has no text in field {cfg.text_field!r}")
    for split in ("train", "val"):
        if counts[split] < MIN_SPLIT_TOKENS:
            hint = "raise --val_fraction" if split == "val" else "lower --val_fraction or add text"
            raise DataError(
                f"{cfg.source}: the {split} split would have {counts[split]:,} tokens, fewer than"
                f" {MIN_SPLIT_TOKENS:,} (one GPT-2 window of 1024 + 1); {hint}"
            )


def _write_shards(state: Path, split: str, ranges: list, total: int, shard_tokens: int) -> list[str]:
    """Concatenates the ranges into shards of shard_tokens tokens (a single file gets nanoGPT's plain name)."""
    n_shards = max(1, -(-total // shard_tokens))
    names = [f"{split}.bin"] if n_shards == 1 else [f"{split}-{i:05d}.bin" for i in range(n_shards)]
    queue = collections.deque(ranges)
    for name in names:
        with open(state / name, "wb") as dst:
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


def _publish(state: Path, out: Path, names: list[str]) -> None:
    """Moves the new files into `out` (meta.json last) and removes token files the new meta does not list."""
    (out / META).unlink(missing_ok=True)  # the corpus is "incomplete" until the new meta lands
    for name in names:
        os.replace(state / name, out / name)
    for p in _token_files(out):
        if p.name not in names:
            p.unlink()
    os.replace(state / META, out / META)


def main(argv: list[str] | None = None) -> None:
    from configs.cli import fail, parse
    from configs.errors import UserError

    cfg = parse(PrepareConfig, argv, prog="python -m data.prepare", description=__doc__)
    try:
        prepare(cfg)
    except (UserError, OSError) as e:
        fail(str(e))


if __name__ == "__main__":
    main()
