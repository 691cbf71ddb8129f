"""Corpus preparation (data.prepare): each stage on its own (read, tokenize, commit, shards), then through the CLI:
formats, the validation split, errors, resume, workers."""

import bz2
import gzip
import json
import lzma
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT
from data import prepare as prep
from data.prepare import DataError, PrepareConfig, commit, main, prepare, shards, sources, tokens
from data.tokenizer import EOT, RANKS_SHA256, get_tokenizer

SHARD = 1 << 16  # the smallest shard_tokens allowed


def _docs(n=40, words=(20, 800), seed=0):
    rng = np.random.RandomState(seed)
    vocab = ["thou", "art", "café", "🚀", "the", "king", "'s", "\n", "12", "lord", "<|endoftext|>"]
    return [" ".join(rng.choice(vocab, size=rng.randint(*words))) for _ in range(n)]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _write_bytes(path, data):
    path.write_bytes(data)
    return str(path)


def _tokens(directory, split):
    meta = json.loads((directory / "meta.json").read_text())
    return np.concatenate([np.fromfile(directory / f, dtype="<u2") for f in meta[f"{split}_files"]])


def _decode_all(directory, split):
    enc = get_tokenizer()
    tokens = _tokens(directory, split)
    return [enc.decode(t.tolist()) for t in np.split(tokens, np.where(tokens == EOT)[0] + 1) if len(t)]


def _files(directory):
    """{name: bytes} of everything prepare left in the directory (token files, meta.json, leftovers)."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _cli(*args):
    main([str(a) for a in args])


def _error(capsys, *args) -> str:
    """The one line a failing CLI run prints (and checks there is no traceback and a non-zero exit)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        _cli(*args)
    err = capsys.readouterr().err + (e.value.code if isinstance(e.value.code, str) else "")
    assert e.value.code not in (0, None)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """8 JSON-lines files, ~2.5 MB of text, and its preparation by one uninterrupted worker."""
    d = tmp_path_factory.mktemp("corpus")
    for i in range(8):
        _write(d / f"part-{i}.jsonl", [{"text": t} for t in _docs(60, (20, 800), seed=i)])
    _cli("--source", d / "*.jsonl", "--out_dir", d / "ref", "--val_fraction", 0.05, "--shard_tokens", SHARD)
    return d


def _args(corpus, out, *more):
    return ["--source", corpus / "*.jsonl", "--out_dir", out, "--val_fraction", 0.05, "--shard_tokens", SHARD, *more]


# ---- the stages, one at a time ------------------------------------------------------------------


def test_plan_cuts_a_large_plain_jsonl_into_line_aligned_ranges(tmp_path, monkeypatch):
    """Each line is read once, by the range it starts in, at its byte offset; a compressed file is one unit."""
    lines = [json.dumps({"text": t}) + "\n" for t in _docs(30, (2, 40))]
    data = "".join(lines).encode()
    (tmp_path / "a.jsonl").write_bytes(data)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(data))
    unit_bytes = len(lines[0].encode())  # the first range ends exactly where the second line starts
    monkeypatch.setattr(sources, "UNIT_BYTES", unit_bytes)
    cfg = PrepareConfig(str(tmp_path / "*.jsonl*"), str(tmp_path / "out"))
    units = sources.plan(cfg)
    ranges = [(u.start, u.end) for u in units[:-1]]
    assert ranges == [(s, min(s + unit_bytes, len(data))) for s in range(0, len(data), unit_bytes)]
    assert units[-1] == sources.Unit(len(ranges), "json", str(tmp_path / "b.jsonl.gz"), file_no=1)
    assert [u.index for u in units] == list(range(len(units)))
    offsets = np.cumsum([0] + [len(line.encode()) for line in lines])[:-1].tolist()
    expected = [sources.Document(pos, json.loads(line)["text"], True) for pos, line in zip(offsets, lines)]
    assert [d for u in units[:-1] for d in sources.read(u, cfg)] == expected
    assert list(sources.read(units[-1], cfg)) == expected


@pytest.mark.parametrize("ext", ["", ".gz", ".xz", ".bz2", ".zst"])
def test_readers_decompress_by_the_files_ending(tmp_path, ext):
    compress = {"": bytes, ".gz": gzip.compress, ".xz": lzma.compress, ".bz2": bz2.compress}
    if ext == ".zst":
        import zstandard  # a dev dependency: the case must run, not skip

        compress[ext] = zstandard.compress
    text = "\n".join(_docs(3))
    path = tmp_path / f"a.txt{ext}"
    path.write_bytes(compress[ext](text.encode()))
    with sources.open_file(str(path)) as f:
        assert f.read() == text.encode()
    cfg = PrepareConfig(str(path), str(tmp_path / "out"))
    (unit,) = sources.plan(cfg)
    assert list(sources.read(unit, cfg)) == [sources.Document(0, text, True)]


def test_zst_without_zstandard_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "zstandard", None)  # as if not installed
    with pytest.raises(DataError, match=r"a.txt.zst: reading .zst needs `pip install zstandard`"):
        sources.open_file(str(tmp_path / "a.txt.zst"))


def test_tokenize_is_the_same_for_any_pieces_batches_or_threads(monkeypatch):
    """Documents cut in pieces before a word (a pre-tokenizer boundary), small batches on two threads: the
    tokens of the whole documents, <|endoftext|> after each, in order, split by each document's label."""
    rng = np.random.RandomState(0)
    docs = [" ".join(rng.choice(["thou", "art", "café", "king", "12"], size=rng.randint(2, 300))) for _ in range(40)]
    whole = [tokens.Labeled(i % 4 == 0, d, True) for i, d in enumerate(docs)]
    pieces = []
    for doc in whole:
        cut = doc.text.find(" ", len(doc.text) // 2)
        halves = [doc._replace(text=doc.text[:cut], last=False), doc._replace(text=doc.text[cut:])]
        pieces += [doc] if cut < 0 else halves

    def run(labeled, threads):
        out = list(tokens.tokenize(labeled, threads))
        return [np.concatenate([b.train for b in out]).tolist(), np.concatenate([b.val for b in out]).tolist(),
                sum(b.documents for b in out)]

    enc = get_tokenizer()
    expected = [sum((enc.encode_ordinary(d.text) + [EOT] for d in whole if d.val == val), []) for val in (False, True)]
    assert run(whole, 1) == [*expected, 40]
    monkeypatch.setattr(tokens, "BATCH_CHARS", 500)
    assert len(pieces) > 60 and len(list(tokens.batches(pieces))) > 20
    assert run(pieces, 2) == [*expected, 40]


def test_assign_labels_by_the_seeded_hash_or_the_named_split():
    docs = [sources.Document(pos, "x", True) for pos in range(1000)]
    cfg = PrepareConfig("x", "y", val_fraction=0.3, seed=3)
    labels = [doc.val for doc in tokens.assign(docs, sources.Unit(0, "json", "f", file_no=2), cfg)]
    assert labels == [prep.is_val(3, 2, pos, 0.3) for pos in range(1000)] and 240 < sum(labels) < 360
    named = PrepareConfig("x", "y", val_split="validation")
    assert {doc.val for doc in tokens.assign(docs, sources.Unit(0, "hub", "validation", all_val=True), named)} == {True}
    assert {doc.val for doc in tokens.assign(docs, sources.Unit(0, "hub", "train"), named)} == {False}


def test_write_shards_cuts_ranges_across_shard_boundaries(tmp_path):
    parts = []
    for i, n in enumerate([5, 7, 4]):
        parts.append((tmp_path / f"part{i}.bin", 0, n))
        np.arange(100 * i, 100 * i + n, dtype="<u2").tofile(parts[-1][0])
    parts[1] = (parts[1][0], 2, 5)  # a range that starts inside its part file
    names = shards.write_shards(tmp_path, "train", parts, 14, shard_tokens=6)
    assert names == ["train-00000.bin", "train-00001.bin", "train-00002.bin"]
    assert [np.fromfile(tmp_path / n, dtype="<u2").tolist() for n in names] == [
        [0, 1, 2, 3, 4, 102], [103, 104, 105, 106, 200, 201], [202, 203]]
    assert shards.write_shards(tmp_path, "val", parts[:1], 5, shard_tokens=6) == ["val.bin"]


def test_commit_protocol_with_two_workers(tmp_path):
    """Worker i of 2 commits units i, i+2; a killed write commits nothing; the second to finish joins the parts
    into one worker's files; a late worker neither finds nor re-creates the work area."""
    for i in range(4):
        _write(tmp_path / f"p{i}.jsonl", [{"text": t} for t in _docs(30, (20, 300), seed=i)])
    out, source = tmp_path / "out", str(tmp_path / "*.jsonl")
    cfgs = [PrepareConfig(source, str(out), val_fraction=0.1, num_workers=2, worker_index=i) for i in range(2)]
    units = sources.plan(cfgs[0])
    state = commit.claim(out, cfgs[0], units)
    assert commit.claim(out, cfgs[1], units) == state and len(units) == 4
    assert [u.index for u in commit.todo(state, units, cfgs[1])] == [1, 3]

    def batches(unit, cfg):
        return tokens.tokenize(tokens.assign(sources.read(unit, cfg), unit, cfg), 1)

    def killed(unit, cfg):
        yield next(batches(unit, cfg))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        commit.write_unit(state, units[0], killed(units[0], cfgs[0]), cfgs[0])
    assert not commit.record_path(state, units[0]).exists() and len(list(state.glob("*.tmp-w0of2"))) == 2
    for cfg in cfgs:
        with commit.worker_lock(state, cfg):
            with pytest.raises(DataError, match=f"worker {cfg.worker_index} of 2 is already running"):
                with commit.worker_lock(state, cfg):
                    pass
            commit.remove_stale(state, "*" + commit.temporary_suffix(cfg))
            for unit in commit.todo(state, units, cfg):
                commit.write_unit(state, unit, batches(unit, cfg), cfg)
        if cfg.worker_index == 0:
            assert commit.all_records(state, units) is None and shards.finalize(out, state, cfg, units) is None
    counts = shards.finalize(out, state, cfgs[1], units)
    assert not state.exists() and not list(out.glob("*.tmp-*"))
    with commit.lock(state / "finalize.lock") as held:
        assert not held and not state.exists()
    prepare(PrepareConfig(source, str(tmp_path / "one"), val_fraction=0.1), quiet=True)
    assert _files(out) == _files(tmp_path / "one")
    meta = json.loads((out / "meta.json").read_text())
    assert counts == {"train": meta["train_tokens"], "val": meta["val_tokens"]}


# ---- formats and the output ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "txt.xz", "parquet"])
def test_round_trips_local_files(tmp_path, kind):
    docs = _docs()
    if kind.startswith("jsonl"):
        src = tmp_path / f"docs.{kind}"
        data = "".join(json.dumps({"body": d}) + "\n" for d in docs).encode()
        src.write_bytes(__import__("gzip").compress(data) if kind.endswith("gz") else data)
        source = src
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        for i in range(2):  # two files: the split and the order span them
            pq.write_table(pa.table({"body": docs[i * 20:(i + 1) * 20]}), tmp_path / f"d{i}.parquet", row_group_size=7)
        source = tmp_path / "*.parquet"
    else:  # one document per file
        for i, d in enumerate(docs):
            with lzma.open(tmp_path / f"doc{i:02d}.txt.xz", "wt") as f:
                f.write(d)
        source = tmp_path / "doc*.txt.xz"
    field = [] if kind.startswith("txt") else ["--text_field", "body"]
    _cli("--source", source, "--out_dir", tmp_path / "out", "--val_fraction", 0.2, *field)
    out = tmp_path / "out"
    meta = json.loads((out / "meta.json").read_text())
    train, val = _decode_all(out, "train"), _decode_all(out, "val")
    assert 2 <= len(val) <= 16 and len(train) + len(val) == 40
    assert sorted(d + "<|endoftext|>" for d in docs) == sorted(train + val)  # "<|endoftext|>" text is ordinary
    assert meta["train_tokens"] == (out / "train.bin").stat().st_size // 2
    assert meta["val_tokens"] == (out / "val.bin").stat().st_size // 2
    assert meta["tokenizer_sha256"] == RANKS_SHA256 and meta["vocab_size"] == 50257 and meta["eot"] == EOT
    assert meta["max_token_id"] == max(_tokens(out, "train").max(), _tokens(out, "val").max())
    assert sorted(os.listdir(out)) == ["meta.json", "train.bin", "val.bin"]  # no work area, no temporaries


def test_validation_split_is_a_seeded_proportional_hash(tmp_path):
    """~val_fraction of the documents, chosen per document: the same for any batch size or thread count."""
    src = _write(tmp_path / "d.jsonl", [{"text": t} for t in _docs(2000, (2, 20))])
    _cli("--source", src, "--out_dir", tmp_path / "a", "--val_fraction", 0.2)
    n_val = len(_decode_all(tmp_path / "a", "val"))
    assert abs(n_val - 400) < 60  # 3.4 sigma of Binomial(2000, 0.2)
    _cli("--source", src, "--out_dir", tmp_path / "b", "--val_fraction", 0.2, "--seed", 7)
    assert _decode_all(tmp_path / "b", "val") != _decode_all(tmp_path / "a", "val")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tokens, "BATCH_CHARS", 1000)
        _cli("--source", src, "--out_dir", tmp_path / "c", "--val_fraction", 0.2, "--num_threads", 1)
    assert _files(tmp_path / "c") == _files(tmp_path / "a")


def test_shards_hold_shard_tokens(corpus):
    out = corpus / "ref"
    meta = json.loads((out / "meta.json").read_text())
    sizes = [(out / f).stat().st_size // 2 for f in meta["train_files"]]
    assert len(sizes) > 3 and meta["train_files"][0] == "train-00000.bin"
    assert all(s == SHARD for s in sizes[:-1]) and sum(sizes) == meta["train_tokens"]
    assert meta["val_files"] == ["val.bin"] and meta["val_tokens"] >= 1025


def test_single_text_file_is_split_by_tokens(tmp_path):
    """nanoGPT's input.txt: one document; the last val_fraction of its tokens are the validation split."""
    text = "".join(lzma.open(prep.SHAKESPEARE, "rt").readline() for _ in range(3))
    text = json.loads(text.splitlines()[2])["text"]
    (tmp_path / "input.txt").write_text(text)
    _cli("--source", tmp_path / "input.txt", "--out_dir", tmp_path / "o", "--val_fraction", 0.1)
    train, val = _tokens(tmp_path / "o", "train"), _tokens(tmp_path / "o", "val")
    expected = get_tokenizer().encode_ordinary(text) + [EOT]
    assert np.concatenate([train, val]).tolist() == expected
    assert len(val) == int(len(expected) * 0.1)


def test_text_pieces_tokenize_like_the_whole(tmp_path, monkeypatch):
    """A large .txt is read in pieces cut where GPT-2's pre-tokenizer cannot join across."""
    text = json.loads(lzma.open(prep.SHAKESPEARE, "rt").readline())["text"][:300_000]
    text += "\n\n  x \r\nend\n \nlast"
    (tmp_path / "a.txt").write_text(text)
    monkeypatch.setattr(sources, "PIECE_CHARS", 2000)
    pieces = list(sources.read(sources.Unit(0, "text", str(tmp_path / "a.txt")), PrepareConfig("x", "y")))
    assert len(pieces) > 50 and [p[2] for p in pieces] == [False] * (len(pieces) - 1) + [True]
    enc = get_tokenizer()
    assert sum((enc.encode_ordinary(p[1]) for p in pieces), []) == enc.encode_ordinary(text)


def test_large_jsonl_byte_ranges_give_the_same_files(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "UNIT_BYTES", 50_000)  # ~6 line-aligned ranges per file
    _cli(*_args(corpus, tmp_path / "o"))
    assert _files(tmp_path / "o") == _files(corpus / "ref")


def test_hub_dataset_streams_by_shard_with_a_named_val_split(tmp_path, monkeypatch):
    """The hub path, with only the name resolved to local parquet files (no network here)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = _docs(30)
    for i in range(3):
        pq.write_table(pa.table({"text": docs[i * 10:(i + 1) * 10]}), tmp_path / f"train-{i}.parquet")
    pq.write_table(pa.table({"text": _docs(5, seed=9)}), tmp_path / "validation.parquet")
    files = {"train": sorted(str(p) for p in tmp_path.glob("train-*")),
             "validation": str(tmp_path / "validation.parquet")}
    real = datasets.load_dataset

    def resolve(path, name=None, **kw):
        assert path == "someone/tiny" and kw["streaming"]
        return real("parquet", data_files=files, **kw)

    monkeypatch.setattr(datasets, "load_dataset", resolve)
    _cli("--source", "someone/tiny", "--val_split", "validation", "--out_dir", tmp_path / "o")
    assert _decode_all(tmp_path / "o", "train") == [d + "<|endoftext|>" for d in docs]  # shard order kept
    assert _decode_all(tmp_path / "o", "val") == [d + "<|endoftext|>" for d in _docs(5, seed=9)]


def test_shakespeare_keeps_about_a_tenth_for_validation(shakespeare):
    meta = json.loads((shakespeare / "meta.json").read_text())
    assert (meta["train_tokens"], meta["val_tokens"]) == (1_364_728, 201_273)
    assert meta["max_token_id"] <= EOT


# ---- re-running, foreign files, bare switches ---------------------------------------------------


def test_is_a_no_op_unless_overwrite(tmp_path, capsys):
    src = _write(tmp_path / "d.jsonl", [{"text": d} for d in _docs()])
    args = ["--source", src, "--out_dir", tmp_path / "out", "--val_fraction", 0.2]
    _cli(*args)
    out = tmp_path / "out"
    before, tokens = (out / "train.bin").stat().st_mtime_ns, _tokens(out, "train").size
    capsys.readouterr()
    _cli(*args)
    assert "already prepared (pass --overwrite to redo)" in capsys.readouterr().out
    assert (out / "train.bin").stat().st_mtime_ns == before
    _write(tmp_path / "d.jsonl", [{"text": d} for d in _docs(20)])
    _cli(*args, "--overwrite")  # the hint works as written: a bare switch
    assert _tokens(out, "train").size < tokens
    _cli(*args, "--no-overwrite")
    assert sorted(os.listdir(out)) == ["meta.json", "train.bin", "val.bin"]


@pytest.mark.parametrize("foreign", ["train.bin", "val-00001.bin", "meta.json"])
def test_refuses_files_it_did_not_write(corpus, tmp_path, capsys, foreign):
    out = tmp_path / "o"
    out.mkdir()
    (out / foreign).write_text('{"mine": 1}')
    assert foreign in _error(capsys, *_args(corpus, out)) and "--overwrite" in _error(capsys, *_args(corpus, out))
    assert (out / foreign).read_text() == '{"mine": 1}'
    _cli(*_args(corpus, out, "--overwrite"))
    assert _files(out) == _files(corpus / "ref")


# ---- errors: one line, before any work ----------------------------------------------------------


VAL_FRACTION = r"--val_fraction must be a finite number in \(0, 1\)"


@pytest.mark.parametrize(
    "make_source, flags, message",
    [
        (lambda p: p / "missing.jsonl", [], "missing.jsonl: no such file or directory"),
        (lambda p: p / "nothing-*.jsonl", [], "no files match"),
        (lambda p: _write(p / "d.jsonl", [{"body": "x"}, {"body": "y"}]), [],
         "line 1: no text field 'text'; fields are"),
        (lambda p: _write(p / "d.jsonl", [{"text": "x"}, {"text": None}]), [],
         "d.jsonl: line 2: text field 'text' is null"),
        (lambda p: _write(p / "d.jsonl", [{"text": ""}, {"text": ""}]), [], "has no text"),
        (lambda p: _write(p / "d.jsonl", []), [], "has no text"),
        (lambda p: _write(p / "d.jsonl", [{"text": t} for t in _docs(4)]), ["--val_fraction", 0.01],
         r"the val split would have 0 tokens, not one window; raise --val_fraction \(about 0.\d+ gives 1,025"),
        (lambda p: _write_bytes(p / "d.jsonl", b'{"text": "bad \xff byte"}\n'), [],
         "d.jsonl: invalid UTF-8 at byte 14"),
        (lambda p: _write(p / "d.jsonl", [{"text": "x"}]), ["--val_fraction", "nan"], VAL_FRACTION),
        (lambda p: _write(p / "d.jsonl", [{"text": "x"}]), ["--val_fraction", "inf"], VAL_FRACTION),
        (lambda p: _write(p / "d.jsonl", [{"text": "x"}]), ["--val_fraction", 1], VAL_FRACTION),
        (lambda p: _write(p / "d.jsonl", [{"text": "x"}]), ["--shard_tokens", 1000],
         "--shard_tokens must be an integer >= 65536"),
        (lambda p: _write(p / "d.jsonl", [{"text": "x"}]), ["--max_documents", 0], "--max_documents must be"),
        (lambda p: _write(p / "d.jsonl", [{"text": "x"}]), ["--num_workers", 0], "--num_workers must be"),
        (lambda p: _write(p / "d.jsonl", [{"text": "x"}]), ["--num_workers", 2, "--worker_index", 2],
         r"--worker_index must be in \[0, 2\)"),
        (lambda p: _write(p / "d.jsonl", [{"text": "x"}]), ["--errors", "ignore"], "errors"),
        (lambda p: _write(p / "d.jsonl", [{"text": "x"}]), ["--val_split", "validation"], "--val_split names a hub"),
    ],
)
def test_errors_are_one_line_naming_the_path_or_flag(tmp_path, capsys, make_source, flags, message):
    import re

    line = _error(capsys, "--source", make_source(tmp_path), "--out_dir", tmp_path / "out", "--val_fraction", 0.5,
                  *flags)
    assert re.search(message, line), line
    assert not (tmp_path / "out").exists()  # nothing created when refused


def test_a_refused_source_leaves_out_dir_as_it_was(tmp_path, capsys):
    """Its missing parents are removed too; an existing out_dir keeps what it held, and only that."""
    bad = _write(tmp_path / "d.jsonl", [{"text": "x"}, {"body": "y"}])
    _error(capsys, "--source", bad, "--out_dir", tmp_path / "new" / "corpus")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    _error(capsys, "--source", bad, "--out_dir", tmp_path / "mine")
    assert _files(tmp_path / "mine") == {"notes.txt": b"keep"}


def test_a_short_split_is_a_warning_and_one_without_a_window_a_refusal(tmp_path, capsys):
    """nanoGPT's input.txt at the default --val_fraction: training may use windows much shorter than GPT-2's."""
    (tmp_path / "input.txt").write_text("ROMEO: But, soft! what light through yonder window breaks?\n" * 4000)
    capsys.readouterr()
    _cli("--source", tmp_path / "input.txt", "--out_dir", tmp_path / "o")
    n_val = json.loads((tmp_path / "o" / "meta.json").read_text())["val_tokens"]
    assert n_val == int((_tokens(tmp_path / "o", "train").size + n_val) * 0.0005) < 1025
    assert capsys.readouterr().err.splitlines() == [
        f"warning: {tmp_path / 'o'}: the val split has {n_val} tokens: windows of up to train.seq_len={n_val - 1}"
        " (GPT-2's is 1024); for longer ones raise --val_fraction (about 0.018 gives 1,025 tokens)"]
    (tmp_path / "short.txt").write_text("ROMEO: But, soft!\n" * 10)
    assert _error(capsys, "--source", tmp_path / "short.txt", "--out_dir", tmp_path / "p") == (
        f"error: {tmp_path / 'short.txt'}: the val split would have 1 tokens, not one window; raise --val_fraction"
        " or add text (81 tokens in all)")
    assert not (tmp_path / "p").exists()


def test_a_bucket_out_dir_is_refused_in_one_line(tmp_path, capsys):
    _write(tmp_path / "d.jsonl", [{"text": "x"}])
    line = _error(capsys, "--source", tmp_path / "d.jsonl", "--out_dir", "gs://bucket/corpus")
    assert "--out_dir gs://bucket/corpus: token files are written to" in line and "gcsfuse" in line


def test_undecodable_text_names_the_byte_or_is_replaced(tmp_path, capsys):
    good = "".join(json.dumps({"text": t}) + "\n" for t in _docs(30)).encode()
    (tmp_path / "d.jsonl").write_bytes(good + b'{"text": "bad \xff byte"}\n')
    args = ["--source", tmp_path / "d.jsonl", "--out_dir", tmp_path / "o", "--val_fraction", 0.3]
    assert _error(capsys, *args) == (f"error: {tmp_path / 'd.jsonl'}: invalid UTF-8 at byte {len(good) + 14}"
                                     " (pass --errors replace to accept it)")
    assert not (tmp_path / "o").exists()
    _cli(*args, "--errors", "replace")
    assert "bad \ufffd byte<|endoftext|>" in _decode_all(tmp_path / "o", "train") + _decode_all(tmp_path / "o", "val")


def test_cli_error_in_a_fresh_process(tmp_path):
    r = subprocess.run([sys.executable, "-m", "data.prepare", "--source", str(tmp_path / "nope.txt"),
                        "--out_dir", str(tmp_path / "o")], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == [f"error: {tmp_path / 'nope.txt'}: no such file or directory"]


def test_max_documents_takes_the_first(tmp_path):
    src = _write(tmp_path / "d.jsonl", [{"text": t} for t in _docs(40)])
    _cli("--source", src, "--out_dir", tmp_path / "o", "--val_fraction", 0.3, "--max_documents", 25)
    kept = sorted(_decode_all(tmp_path / "o", "train") + _decode_all(tmp_path / "o", "val"))
    assert kept == sorted(d + "<|endoftext|>" for d in _docs(40)[:25])


# ---- resume, workers, stale temporaries ---------------------------------------------------------


def test_kill_9_then_rerun_gives_the_uninterrupted_files(corpus, tmp_path, capsys):
    out = tmp_path / "o"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "data.prepare", *map(str, _args(corpus, out, "--num_threads", 1))]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not (out / ".prepare" / "unit-00001.json").exists() and time.time() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    state = out / ".prepare"
    assert not (out / "meta.json").exists() and (state / "unit-00001.json").exists()
    done = {int(p.name[5:10]) for p in state.glob("unit-*.json")}
    assert len(done) < 8
    line = _error(capsys, *_args(corpus, out, "--seed", 5))  # other settings over a partial output
    assert "other settings (seed)" in line and "--overwrite" in line
    redone, write_unit = [], commit.write_unit
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(commit, "write_unit",
                   lambda state, unit, *a: (redone.append(unit.index), write_unit(state, unit, *a)))
        _cli(*_args(corpus, out))
    assert sorted(redone) == sorted(set(range(8)) - done)  # finished units are kept, not redone
    assert _files(out) == _files(corpus / "ref")


def test_workers_together_give_one_workers_files(corpus, tmp_path, capsys):
    for n in (2, 3):
        out = tmp_path / f"w{n}"
        for i in range(n):  # run one after another; the last to finish writes meta.json
            assert not (out / "meta.json").exists()
            _cli(*_args(corpus, out, "--num_workers", n, "--worker_index", i))
        assert _files(out) == _files(corpus / "ref")


def test_removes_its_own_stale_temporaries_but_not_a_live_workers(corpus, tmp_path):
    out = tmp_path / "o"
    _cli(*_args(corpus, out, "--num_workers", 2, "--worker_index", 1))
    state = out / ".prepare"
    (state / "unit-00000.train.bin.tmp-w0of2").write_bytes(b"killed")  # worker 0's, from a killed run
    (state / "unit-00002.train.bin.tmp-w0of3").write_bytes(b"live")  # another run's worker, maybe alive
    (out / ".tmp-prepare-old").mkdir()  # an earlier version's
    with commit.lock(state / "worker-0-of-2.lock") as held:  # a live worker 0 is refused, keeps its files
        assert held
        with pytest.raises(DataError, match="worker 0 of 2 is already running"):
            prepare(PrepareConfig(**_cfg(corpus, out), num_workers=2, worker_index=0), quiet=True)
    assert (state / "unit-00000.train.bin.tmp-w0of2").exists()
    with pytest.MonkeyPatch.context() as mp:
        seen = []
        mp.setattr(shards, "finalize", lambda *a: seen.append(sorted(p.name for p in state.glob("*.tmp-*"))))
        prepare(PrepareConfig(**_cfg(corpus, out), num_workers=2, worker_index=0), quiet=True)
    assert seen == [["unit-00002.train.bin.tmp-w0of3"]] and not (out / ".tmp-prepare-old").exists()
    _cli(*_args(corpus, out, "--num_workers", 2, "--worker_index", 0))  # the last one finalizes, cleans all
    assert _files(out) == _files(corpus / "ref")


def _cfg(corpus, out):
    return dict(source=str(corpus / "*.jsonl"), out_dir=str(out), val_fraction=0.05, shard_tokens=SHARD)
