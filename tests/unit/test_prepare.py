"""Corpus preparation (data.prepare), each stage on its own (plan, read, tokenize, label, commit, shards), and the
errors that end it in one line before any work. Whole preparations: tests/e2e/test_prepare.py."""

import bz2
import gzip
import json
import lzma
import sys

import numpy as np
import pytest

from data import prepare as prep
from data.prepare import DataError, PrepareConfig, commit, prepare, shards, sources, tokens
from data.tokenizer import EOT, get_tokenizer
from support.corpora import files_of, prepare_error, random_docs, write_jsonl

SHARD = 1 << 16  # the smallest shard_tokens allowed


def _write_bytes(path, data):
    path.write_bytes(data)
    return str(path)


def test_plan_cuts_a_large_plain_jsonl_into_line_aligned_ranges(tmp_path, monkeypatch):
    """Each line is read once, by the range it starts in, at its byte offset; a compressed file is one unit."""
    lines = [json.dumps({"text": t}) + "\n" for t in random_docs(30, (2, 40))]
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
    text = "\n".join(random_docs(3))
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
        write_jsonl(tmp_path / f"p{i}.jsonl", [{"text": t} for t in random_docs(30, (20, 300), seed=i)])
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
    assert files_of(out) == files_of(tmp_path / "one")
    meta = json.loads((out / "meta.json").read_text())
    assert counts == {"train": meta["train_tokens"], "val": meta["val_tokens"]}


VAL_FRACTION = r"--val_fraction must be a finite number in \(0, 1\)"


@pytest.mark.parametrize(
    "make_source, flags, message",
    [
        (lambda p: p / "missing.jsonl", [], "missing.jsonl: no such file or directory"),
        (lambda p: p / "nothing-*.jsonl", [], "no files match"),
        (lambda p: write_jsonl(p / "d.jsonl", [{"body": "x"}, {"body": "y"}]), [],
         "line 1: no text field 'text'; fields are"),
        (lambda p: write_jsonl(p / "d.jsonl", [{"text": "x"}, {"text": None}]), [],
         "d.jsonl: line 2: text field 'text' is null"),
        (lambda p: write_jsonl(p / "d.jsonl", [{"text": ""}, {"text": ""}]), [], "has no text"),
        (lambda p: write_jsonl(p / "d.jsonl", []), [], "has no text"),
        (lambda p: write_jsonl(p / "d.jsonl", [{"text": t} for t in random_docs(4)]), ["--val_fraction", 0.01],
         r"the val split would have 0 tokens, not one window; raise --val_fraction \(about 0.\d+ gives 1,025"),
        (lambda p: _write_bytes(p / "d.jsonl", b'{"text": "bad \xff byte"}\n'), [],
         "d.jsonl: invalid UTF-8 at byte 14"),
        (lambda p: write_jsonl(p / "d.jsonl", [{"text": "x"}]), ["--val_fraction", "nan"], VAL_FRACTION),
        (lambda p: write_jsonl(p / "d.jsonl", [{"text": "x"}]), ["--val_fraction", "inf"], VAL_FRACTION),
        (lambda p: write_jsonl(p / "d.jsonl", [{"text": "x"}]), ["--val_fraction", 1], VAL_FRACTION),
        (lambda p: write_jsonl(p / "d.jsonl", [{"text": "x"}]), ["--shard_tokens", 1000],
         "--shard_tokens must be an integer >= 65536"),
        (lambda p: write_jsonl(p / "d.jsonl", [{"text": "x"}]), ["--max_documents", 0], "--max_documents must be"),
        (lambda p: write_jsonl(p / "d.jsonl", [{"text": "x"}]), ["--num_workers", 0], "--num_workers must be"),
        (lambda p: write_jsonl(p / "d.jsonl", [{"text": "x"}]), ["--num_workers", 2, "--worker_index", 2],
         r"--worker_index must be in \[0, 2\)"),
        (lambda p: write_jsonl(p / "d.jsonl", [{"text": "x"}]), ["--errors", "ignore"], "errors"),
        (lambda p: write_jsonl(p / "d.jsonl", [{"text": "x"}]), ["--val_split", "validation"], "--val_split names a hub"),
    ],
)
def test_errors_are_one_line_naming_the_path_or_flag(tmp_path, capsys, make_source, flags, message):
    import re

    line = prepare_error(capsys, "--source", make_source(tmp_path), "--out_dir", tmp_path / "out", "--val_fraction", 0.5,
                  *flags)
    assert re.search(message, line), line
    assert not (tmp_path / "out").exists()  # nothing created when refused


def test_a_refused_source_leaves_out_dir_as_it_was(tmp_path, capsys):
    """Its missing parents are removed too; an existing out_dir keeps what it held, and only that."""
    bad = write_jsonl(tmp_path / "d.jsonl", [{"text": "x"}, {"body": "y"}])
    prepare_error(capsys, "--source", bad, "--out_dir", tmp_path / "new" / "corpus")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    prepare_error(capsys, "--source", bad, "--out_dir", tmp_path / "mine")
    assert files_of(tmp_path / "mine") == {"notes.txt": b"keep"}


def test_a_bucket_out_dir_is_refused_in_one_line(tmp_path, capsys):
    write_jsonl(tmp_path / "d.jsonl", [{"text": "x"}])
    line = prepare_error(capsys, "--source", tmp_path / "d.jsonl", "--out_dir", "gs://bucket/corpus")
    assert "--out_dir gs://bucket/corpus: token files are written to" in line and "gcsfuse" in line
