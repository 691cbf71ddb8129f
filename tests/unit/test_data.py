"""Tokenizer and the Grain loader (corpus preparation: test_prepare.py)."""

import hashlib
import itertools
import json
import shutil

import numpy as np
import pytest

from data import tokenizer
from data.loader import LoaderConfig, TokenWindows, make_dataset, open_corpus
from data.tokenizer import EOT, RANKS_FILE, RANKS_SHA256, get_tokenizer
from errors import DataError

SAMPLE = (
    "Hello world<|endoftext|> It's 2024: naïve café — 𝔘𝔫𝔦𝔠𝔬𝔡𝔢, emojis 🤖🚀, tabs\t\tand   spaces,\n\n"
    "code: def f(x): return x**2  # comment\nnumbers 1234567 3.14159 -42, CAPS and MiXeD, don't won't y'all"
)


# ---- tokenizer ---------------------------------------------------------------------------------


def test_shipped_rank_file_is_tiktokens_r50k_base():
    data = RANKS_FILE.read_bytes()
    assert len(data) == 835_554
    assert hashlib.sha256(data).hexdigest() == RANKS_SHA256


def test_encoding_equals_tiktokens_own(tmp_path, monkeypatch):
    """tiktoken's registered r50k_base (GPT-2's ranks and regex), fed the same file via its cache."""
    import tiktoken
    import tiktoken.registry

    url = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
    shutil.copy(RANKS_FILE, tmp_path / hashlib.sha1(url.encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    reference = tiktoken.get_encoding("r50k_base")
    ours = get_tokenizer()
    assert ours.encode(SAMPLE, allowed_special="all") == reference.encode(SAMPLE, allowed_special="all")
    assert ours.encode("Hello world<|endoftext|>", allowed_special="all") == [15496, 995, 50256]
    assert ours.decode(ours.encode(SAMPLE, allowed_special="all")) == SAMPLE
    assert ours.n_vocab == 50257 and ours.eot_token == EOT


def test_corrupt_rank_file_is_refused(tmp_path, monkeypatch):
    bad = tmp_path / "r50k_base.tiktoken"
    bad.write_bytes(RANKS_FILE.read_bytes()[:-10])
    monkeypatch.setattr(tokenizer, "RANKS_FILE", bad)
    tokenizer.get_tokenizer.cache_clear()
    try:
        with pytest.raises(ValueError, match="corrupt tokenizer file"):
            tokenizer.get_tokenizer()
    finally:
        tokenizer.get_tokenizer.cache_clear()


# ---- loader ------------------------------------------------------------------------------------


def _batches(files, n, **kw):
    cfg = LoaderConfig(**{"seq_len": 32, "batch_size": 4, "seed": 0, **kw})
    return list(itertools.islice(make_dataset(files, 50257, cfg, shard_index=0, shard_count=1), n))


def test_windows_are_shifted_targets_within_vocab(shakespeare):
    files = open_corpus(shakespeare, vocab_size=50257, min_tokens=33).files("train")
    source = TokenWindows(files, 32, 50257)
    tokens = np.fromfile(files[0], dtype="<u2")
    assert len(source) == (len(tokens) - 1) // 32
    np.testing.assert_array_equal(source[5], tokens[160:193])  # inputs = w[:-1], targets = w[1:]
    batch = _batches(files, 1)[0]
    assert batch.shape == (4, 33) and batch.dtype == np.int32
    assert batch.max() < 50257 and batch.min() >= 0


def test_same_seed_same_batches_other_seed_other_order(shakespeare):
    files = open_corpus(shakespeare, vocab_size=50257, min_tokens=33).files("train")
    a, b, c = _batches(files, 5), _batches(files, 5), _batches(files, 5, seed=1)
    assert all((x == y).all() for x, y in zip(a, b))
    assert not all((x == y).all() for x, y in zip(a, c))


def test_the_data_position_is_rows_consumed_for_any_batch_size(shakespeare):
    """The position the checkpoint records (rows of the global permutation) moves to another batch size:
    8 batches of 4 rows read, then seeking a batch-8 iterator to those 32 rows gives the next rows."""
    from trainer.run.data_position import rows_consumed, seek

    files = open_corpus(shakespeare, vocab_size=50257, min_tokens=33).files("train")
    rows4 = np.concatenate(_batches(files, 12))  # [48, 33]
    it = iter(make_dataset(files, 50257, LoaderConfig(seq_len=32, batch_size=4, seed=0), shard_index=0, shard_count=1))
    for _ in range(8):
        next(it)
    assert rows_consumed(it, 4) == 32
    it8 = iter(make_dataset(files, 50257, LoaderConfig(seq_len=32, batch_size=8, seed=0), shard_index=0, shard_count=1))
    seek(it8, 32, 8)
    np.testing.assert_array_equal(next(it8), rows4[32:40])
    with pytest.raises(DataError, match="not a whole number of batches of 8"):
        seek(it8, 36, 8)


@pytest.mark.parametrize("count", [2, 4])
def test_process_shards_are_disjoint_and_cover_the_epoch(tmp_path, count):
    tokens = np.arange(64 * 10 + 1, dtype="<u2")  # 20 windows of 32, each identified by its first token
    (tmp_path / "t.bin").write_bytes(tokens.tobytes())
    files = [tmp_path / "t.bin"]
    cfg = LoaderConfig(seq_len=32, batch_size=1, seed=3, num_epochs=1)
    shards = [
        [int(b[0, 0]) // 32 for b in make_dataset(files, 50257, cfg, shard_index=i, shard_count=count)]
        for i in range(count)
    ]
    seen = [w for s in shards for w in s]
    assert len(seen) == len(set(seen)) == 20  # disjoint, and together the whole epoch
    # every process strides over one global permutation: interleaving the shards gives it back
    whole = [int(b[0, 0]) // 32 for b in make_dataset(files, 50257, cfg, shard_index=0, shard_count=1)]
    assert [shards[i % count][i // count] for i in range(20)] == whole


def test_uneven_shards_differ_by_at_most_one_window(tmp_path):
    (tmp_path / "t.bin").write_bytes(np.arange(32 * 10 + 1, dtype="<u2").tobytes())  # 10 windows, 4 shards
    cfg = LoaderConfig(seq_len=32, batch_size=1, seed=3, num_epochs=1)
    sizes = [len(list(make_dataset([tmp_path / "t.bin"], 50257, cfg, shard_index=i, shard_count=4)))
             for i in range(4)]
    assert sizes == [3, 3, 2, 2]


def test_iterator_state_resumes_exactly_through_orbax(shakespeare, tmp_path):
    import grain
    import orbax.checkpoint as ocp

    files = open_corpus(shakespeare, vocab_size=50257, min_tokens=33).files("train")
    cfg = LoaderConfig(seq_len=32, batch_size=4, seed=7)
    uninterrupted = list(itertools.islice(make_dataset(files, 50257, cfg, shard_index=0, shard_count=1), 8))
    it = iter(make_dataset(files, 50257, cfg, shard_index=0, shard_count=1))
    for _ in range(5):
        next(it)
    with ocp.CheckpointManager(tmp_path / "ckpt", item_names=("data",)) as mngr:
        mngr.save(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
        mngr.wait_until_finished()
        fresh = iter(make_dataset(files, 50257, cfg, shard_index=0, shard_count=1))
        mngr.restore(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh)))
    for expected in uninterrupted[5:]:
        np.testing.assert_array_equal(next(fresh), expected)


@pytest.mark.timeout(120)  # a worker killed under the iterator leaves it waiting, not failing
def test_worker_processes_give_the_same_batches_and_go_on_after_a_set_state(shakespeare):
    """Grain replaces the thread that started its workers when the iterator's state is set (a resume): why
    data/orphans.py does not end a worker with PR_SET_PDEATHSIG, which fires on that thread's end (tried: this
    test then waits forever on the second batch)."""
    files = open_corpus(shakespeare, vocab_size=50257, min_tokens=33).files("train")
    in_process = _batches(files, 6)
    cfg = LoaderConfig(seq_len=32, batch_size=4, seed=0, num_workers=2)
    it = iter(make_dataset(files, 50257, cfg, shard_index=0, shard_count=1))
    try:
        workers = [next(it) for _ in range(2)]
        state = it.get_state()
        next(it)
        it.set_state(state)  # back one batch, with the workers already running
        workers += [next(it) for _ in range(4)]
    finally:
        it.close()
    assert len(workers) == 6 and all((a == b).all() for a, b in zip(in_process, workers))


# ---- corpus validation -------------------------------------------------------------------------


def damaged_copy(shakespeare, tmp_path):
    d = tmp_path / "c"
    shutil.copytree(shakespeare, d)
    return d


def test_open_corpus_errors_name_the_path(shakespeare, tmp_path):
    with pytest.raises(DataError, match="none: no such corpus directory; prepare one there: python -m data.prepare"):
        open_corpus(tmp_path / "none", vocab_size=50257, min_tokens=33)
    (tmp_path / "text.jsonl").write_text("{}\n")
    with pytest.raises(DataError, match="text.jsonl is a file, not a prepared corpus directory; tokenize it first"):
        open_corpus(tmp_path / "text.jsonl", vocab_size=50257, min_tokens=33)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="meta.json: missing, so .*empty is not a prepared corpus; prepare one there"):
        open_corpus(tmp_path / "empty", vocab_size=50257, min_tokens=33)
    d = damaged_copy(shakespeare, tmp_path)
    with pytest.raises(DataError, match="fewer than one window"):
        open_corpus(d, vocab_size=50257, min_tokens=10**9)
    with pytest.raises(DataError, match="exceeds the model's 1000"):
        open_corpus(d, vocab_size=1000, min_tokens=33)
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps({**meta, "tokenizer": "cl100k_base", "tokenizer_sha256": "abc"}))
    with pytest.raises(DataError, match="tokenized with 'cl100k_base'"):
        open_corpus(d, vocab_size=50257, min_tokens=33)
    (d / "meta.json").write_text(json.dumps(meta))
    with open(d / "val.bin", "ab") as f:
        f.write(b"\x01")
    with pytest.raises(DataError, match="val.bin: .* not a whole number of uint16 tokens"):
        open_corpus(d, vocab_size=50257, min_tokens=33)
    (d / "meta.json").unlink()
    with pytest.raises(DataError, match="meta.json: missing"):
        open_corpus(d, vocab_size=50257, min_tokens=33)


def test_token_ids_beyond_the_vocabulary_are_reported(tmp_path):
    (tmp_path / "t.bin").write_bytes(np.full(100, 60000, dtype="<u2").tobytes())
    with pytest.raises(DataError, match="token id 60000 .* >= vocab size 50257"):
        TokenWindows([tmp_path / "t.bin"], 32, 50257)[0]


def test_the_loader_needs_the_file_format_not_the_writer():
    """data.loader's imports, followed through the repository's own modules, reach data.format and never
    data.prepare (the reader of the files does not depend on their writer)."""
    import ast

    from support.cli import ROOT

    seen, todo = set(), ["data.loader"]
    while todo:
        name = todo.pop()
        path = ROOT / (name.replace(".", "/") + ".py")
        if name in seen or not path.is_file():
            continue
        seen.add(name)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                todo += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    assert "data.format" in seen and not any(m.startswith("data.prepare") for m in seen), sorted(seen)
