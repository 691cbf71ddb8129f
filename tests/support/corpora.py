"""Corpora for tests: sources written for data.prepare (random documents, JSON lines), prepare's command line called
in-process, and copies of a prepared corpus damaged on purpose."""

import json
import shutil

import numpy as np
import pytest

from data.prepare.cli import main


def damaged_copy(shakespeare, tmp_path, damage):
    d = tmp_path / "corpus"
    shutil.copytree(shakespeare, d)
    damage(d)
    return d


def edit_meta(d, **changes):
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps({**meta, **changes}))


def truncate_train_bin(d):
    tokens = np.fromfile(d / "train.bin", dtype="<u2")[:500_000]
    tokens.tofile(d / "train.bin")


def random_docs(n=40, words=(20, 800), seed=0):
    rng = np.random.RandomState(seed)
    vocab = ["thou", "art", "café", "🚀", "the", "king", "'s", "\n", "12", "lord", "<|endoftext|>"]
    return [" ".join(rng.choice(vocab, size=rng.randint(*words))) for _ in range(n)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def files_of(directory):
    """{name: bytes} of everything prepare left in the directory (token files, meta.json, leftovers)."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def prepare_cli(*args):
    main([str(a) for a in args])


def prepare_error(capsys, *args) -> str:
    """The one line a failing CLI run prints (and checks there is no traceback and a non-zero exit)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        prepare_cli(*args)
    err = capsys.readouterr().err + (e.value.code if isinstance(e.value.code, str) else "")
    assert e.value.code not in (0, None)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]
