"""Corpus preparation (data.prepare) through its command line: formats, the validation split, no-op reruns, foreign
files, undecodable text, resume after kill -9, workers."""

import json
import lzma
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from support.cli import ROOT
from support.corpora import files_of, prepare_cli, prepare_error, random_docs, write_jsonl
from data import prepare as prep
from data.prepare import DataError, PrepareConfig, commit, prepare, shards, sources, tokens
from data.tokenizer import EOT, RANKS_SHA256, get_tokenizer

SHARD = 1 << 16  # the smallest shard_tokens allowed


def _tokens(directory, split):
    meta = json.loads((directory / "meta.json").read_text())
    return np.concatenate([np.fromfile(directory / f, dtype="<u2") for f in meta[f"{split}_files"]])


def _decode_all(directory, split):
    enc = get_tokenizer()
    tokens = _tokens(directory, split)
    return [enc.decode(t.tolist()) for t in np.split(tokens, np.where(tokens == EOT)[0] + 1) if len(t)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """8 JSON-lines files, ~2.5 MB of text, and its preparation by one uninterrupted worker."""
    d = tmp_path_factory.mktemp("corpus")
    for i in range(8):
        write_jsonl(d / f"part-{i}.jsonl", [{"text": t} for t in random_docs(60, (20, 800), seed=i)])
    prepare_cli("--source", d / "*.jsonl", "--out_dir", d / "ref", "--val_fraction", 0.05, "--shard_tokens", SHARD)
    return d


def _args(corpus, out, *more):
    return ["--source", corpus / "*.jsonl", "--out_dir", out, "--val_fraction", 0.05, "--shard_tokens", SHARD, *more]


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "txt.xz", "parquet"])
def test_round_trips_local_files(tmp_path, kind):
    docs = random_docs()
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
    prepare_cli("--source", source, "--out_dir", tmp_path / "out", "--val_fraction", 0.2, *field)
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
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in random_docs(2000, (2, 20))])
    prepare_cli("--source", src, "--out_dir", tmp_path / "a", "--val_fraction", 0.2)
    n_val = len(_decode_all(tmp_path / "a", "val"))
    assert abs(n_val - 400) < 60  # 3.4 sigma of Binomial(2000, 0.2)
    prepare_cli("--source", src, "--out_dir", tmp_path / "b", "--val_fraction", 0.2, "--seed", 7)
    assert _decode_all(tmp_path / "b", "val") != _decode_all(tmp_path / "a", "val")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tokens, "BATCH_CHARS", 1000)
        prepare_cli("--source", src, "--out_dir", tmp_path / "c", "--val_fraction", 0.2, "--num_threads", 1)
    assert files_of(tmp_path / "c") == files_of(tmp_path / "a")


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
    prepare_cli("--source", tmp_path / "input.txt", "--out_dir", tmp_path / "o", "--val_fraction", 0.1)
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
    prepare_cli(*_args(corpus, tmp_path / "o"))
    assert files_of(tmp_path / "o") == files_of(corpus / "ref")


def test_hub_dataset_streams_by_shard_with_a_named_val_split(tmp_path, monkeypatch):
    """The hub path, with only the name resolved to local parquet files (no network here)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = random_docs(30)
    for i in range(3):
        pq.write_table(pa.table({"text": docs[i * 10:(i + 1) * 10]}), tmp_path / f"train-{i}.parquet")
    pq.write_table(pa.table({"text": random_docs(5, seed=9)}), tmp_path / "validation.parquet")
    files = {"train": sorted(str(p) for p in tmp_path.glob("train-*")),
             "validation": str(tmp_path / "validation.parquet")}
    real = datasets.load_dataset

    def resolve(path, name=None, **kw):
        assert path == "someone/tiny" and kw["streaming"]
        return real("parquet", data_files=files, **kw)

    monkeypatch.setattr(datasets, "load_dataset", resolve)
    prepare_cli("--source", "someone/tiny", "--val_split", "validation", "--out_dir", tmp_path / "o")
    assert _decode_all(tmp_path / "o", "train") == [d + "<|endoftext|>" for d in docs]  # shard order kept
    assert _decode_all(tmp_path / "o", "val") == [d + "<|endoftext|>" for d in random_docs(5, seed=9)]


def test_shakespeare_keeps_about_a_tenth_for_validation(shakespeare):
    meta = json.loads((shakespeare / "meta.json").read_text())
    assert (meta["train_tokens"], meta["val_tokens"]) == (1_364_728, 201_273)
    assert meta["max_token_id"] <= EOT


def test_is_a_no_op_unless_overwrite(tmp_path, capsys):
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in random_docs()])
    args = ["--source", src, "--out_dir", tmp_path / "out", "--val_fraction", 0.2]
    prepare_cli(*args)
    out = tmp_path / "out"
    before, tokens = (out / "train.bin").stat().st_mtime_ns, _tokens(out, "train").size
    capsys.readouterr()
    prepare_cli(*args)
    assert "already prepared (pass --overwrite to redo)" in capsys.readouterr().out
    assert (out / "train.bin").stat().st_mtime_ns == before
    write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in random_docs(20)])
    prepare_cli(*args, "--overwrite")  # the hint works as written: a bare switch
    assert _tokens(out, "train").size < tokens
    prepare_cli(*args, "--no-overwrite")
    assert sorted(os.listdir(out)) == ["meta.json", "train.bin", "val.bin"]


@pytest.mark.parametrize("foreign", ["train.bin", "val-00001.bin", "meta.json"])
def test_refuses_files_it_did_not_write(corpus, tmp_path, capsys, foreign):
    out = tmp_path / "o"
    out.mkdir()
    (out / foreign).write_text('{"mine": 1}')
    said = prepare_error(capsys, *_args(corpus, out))
    assert foreign in said and "--overwrite" in said
    assert (out / foreign).read_text() == '{"mine": 1}'
    prepare_cli(*_args(corpus, out, "--overwrite"))
    assert files_of(out) == files_of(corpus / "ref")


def test_a_short_split_is_a_warning_and_one_without_a_window_a_refusal(tmp_path, capsys):
    """nanoGPT's input.txt at the default --val_fraction: training may use windows much shorter than GPT-2's."""
    (tmp_path / "input.txt").write_text("ROMEO: But, soft! what light through yonder window breaks?\n" * 4000)
    capsys.readouterr()
    prepare_cli("--source", tmp_path / "input.txt", "--out_dir", tmp_path / "o")
    n_val = json.loads((tmp_path / "o" / "meta.json").read_text())["val_tokens"]
    assert n_val == int((_tokens(tmp_path / "o", "train").size + n_val) * 0.0005) < 1025
    assert capsys.readouterr().err.splitlines() == [
        f"warning: {tmp_path / 'o'}: the val split has {n_val} tokens: windows of up to train.seq_len={n_val - 1}"
        " (GPT-2's is 1024); for longer ones raise --val_fraction (about 0.018 gives 1,025 tokens)"]
    (tmp_path / "short.txt").write_text("ROMEO: But, soft!\n" * 10)
    assert prepare_error(capsys, "--source", tmp_path / "short.txt", "--out_dir", tmp_path / "p") == (
        f"error: {tmp_path / 'short.txt'}: the val split would have 1 tokens, not one window; raise --val_fraction"
        " or add text (81 tokens in all)")
    assert not (tmp_path / "p").exists()


def test_undecodable_text_names_the_byte_or_is_replaced(tmp_path, capsys):
    good = "".join(json.dumps({"text": t}) + "\n" for t in random_docs(30)).encode()
    (tmp_path / "d.jsonl").write_bytes(good + b'{"text": "bad \xff byte"}\n')
    args = ["--source", tmp_path / "d.jsonl", "--out_dir", tmp_path / "o", "--val_fraction", 0.3]
    assert prepare_error(capsys, *args) == (f"error: {tmp_path / 'd.jsonl'}: invalid UTF-8 at byte {len(good) + 14}"
                                     " (pass --errors replace to accept it)")
    assert not (tmp_path / "o").exists()
    prepare_cli(*args, "--errors", "replace")
    assert "bad \ufffd byte<|endoftext|>" in _decode_all(tmp_path / "o", "train") + _decode_all(tmp_path / "o", "val")


def test_cli_error_in_a_fresh_process(tmp_path):
    r = subprocess.run([sys.executable, "-m", "data.prepare", "--source", str(tmp_path / "nope.txt"),
                        "--out_dir", str(tmp_path / "o")], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == [f"error: {tmp_path / 'nope.txt'}: no such file or directory"]


def test_max_documents_takes_the_first(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in random_docs(40)])
    prepare_cli("--source", src, "--out_dir", tmp_path / "o", "--val_fraction", 0.3, "--max_documents", 25)
    kept = sorted(_decode_all(tmp_path / "o", "train") + _decode_all(tmp_path / "o", "val"))
    assert kept == sorted(d + "<|endoftext|>" for d in random_docs(40)[:25])


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
    line = prepare_error(capsys, *_args(corpus, out, "--seed", 5))  # other settings over a partial output
    assert "other settings (seed)" in line and "--overwrite" in line
    redone, write_unit = [], commit.write_unit
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(commit, "write_unit",
                   lambda state, unit, *a: (redone.append(unit.index), write_unit(state, unit, *a)))
        prepare_cli(*_args(corpus, out))
    assert sorted(redone) == sorted(set(range(8)) - done)  # finished units are kept, not redone
    assert files_of(out) == files_of(corpus / "ref")


def test_workers_together_give_one_workers_files(corpus, tmp_path, capsys):
    for n in (2, 3):
        out = tmp_path / f"w{n}"
        for i in range(n):  # run one after another; the last to finish writes meta.json
            assert not (out / "meta.json").exists()
            prepare_cli(*_args(corpus, out, "--num_workers", n, "--worker_index", i))
        assert files_of(out) == files_of(corpus / "ref")


def test_removes_its_own_stale_temporaries_but_not_a_live_workers(corpus, tmp_path):
    out = tmp_path / "o"
    prepare_cli(*_args(corpus, out, "--num_workers", 2, "--worker_index", 1))
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
    prepare_cli(*_args(corpus, out, "--num_workers", 2, "--worker_index", 0))  # the last one finalizes, cleans all
    assert files_of(out) == files_of(corpus / "ref")


def _cfg(corpus, out):
    return dict(source=str(corpus / "*.jsonl"), out_dir=str(out), val_fraction=0.05, shard_tokens=SHARD)
