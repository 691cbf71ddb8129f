"""Faults through the real train.py / eval.py CLIs: kills, signals, divergence, full disks, bad input.

Every case runs a tiny model (2 layers, width 32) on the embedded corpus in a subprocess and compares with an
uninterrupted run of the same config.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT, SMALL, read_jsonl, run_cli

# 2 steps per call, a checkpoint after every call, an evaluation every 8 steps
FAULT = [*SMALL, "--train.steps=16", "--checkpoint.every=2", "--checkpoint.keep=3", "--train.eval_every=8"]


def args(run_dir, shakespeare, *extra):
    return ["--run_dir", str(run_dir), f"--data.cache_dir={shakespeare}", *FAULT, *extra]


def losses(run_dir):
    return [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


def checkpoint_steps(run_dir):
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def reference(tmp_path_factory, shakespeare):
    run_dir = tmp_path_factory.mktemp("reference")
    r = run_cli("train.py", *args(run_dir, shakespeare), devices=2)
    assert r.returncode == 0, r.stderr[-3000:]
    return losses(run_dir)


def start(run_dir, shakespeare, *extra, devices=2):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return subprocess.Popen([sys.executable, "train.py", *args(run_dir, shakespeare, *extra)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(condition, proc, timeout=300):
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, f"train.py ended early:\n{proc.stderr.read()[-3000:]}"
        assert time.time() < deadline, "timed out waiting for the run to reach the fault point"
        time.sleep(0.02)


def n_steps_logged(run_dir):
    path = run_dir / "metrics.jsonl"
    return len([line for line in path.read_text().splitlines() if '"loss"' in line]) if path.exists() else 0


def restart_and_compare(run_dir, shakespeare, reference, devices=2):
    r = run_cli("train.py", *args(run_dir, shakespeare), devices=devices)
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(run_dir) == reference  # bitwise, from the restored step on
    return r


# ---- kill -9 ------------------------------------------------------------------------------------


def _mid_save(run_dir):
    ckpt = run_dir / "checkpoints"
    return ckpt.exists() and any("tmp" in p.name for p in ckpt.iterdir())


def _mid_eval(run_dir):
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return False
    records = read_jsonl(path)
    return any(r["step"] == 8 and "loss" in r for r in records) and not any("val_loss" in r for r in records)


@pytest.mark.parametrize("point", ["between_steps", "during_async_save", "during_eval"])
def test_kill_9_then_restart_continues_exactly(tmp_path, shakespeare, reference, point):
    extra = ["--train.eval_batches=200"] if point == "during_eval" else []  # a long evaluation to land in
    proc = start(tmp_path, shakespeare, *extra)
    condition = {
        "between_steps": lambda: n_steps_logged(tmp_path) >= 5,
        "during_async_save": lambda: n_steps_logged(tmp_path) >= 2 and _mid_save(tmp_path),
        "during_eval": lambda: _mid_eval(tmp_path),
    }[point]
    wait_for(condition, proc)
    proc.kill()
    proc.wait()
    steps_before = checkpoint_steps(tmp_path)
    r = restart_and_compare(tmp_path, shakespeare, reference)
    if steps_before:
        assert f"resumed from {tmp_path / 'checkpoints' / str(steps_before[-1])}" in r.stdout
    assert not any("tmp" in p.name for p in (tmp_path / "checkpoints").iterdir())


# ---- signals ------------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_the_current_step_and_exits_0(tmp_path, shakespeare, reference, sig):
    proc = start(tmp_path, shakespeare, "--checkpoint.every=1000")
    wait_for(lambda: n_steps_logged(tmp_path) >= 4, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    step = n_steps_logged(tmp_path)
    assert checkpoint_steps(tmp_path) == [step]
    assert f"stopped by {sig.name} at step {step}; checkpoint saved, restart to resume" in out
    restart_and_compare(tmp_path, shakespeare, reference)


# ---- divergence ---------------------------------------------------------------------------------


def test_divergence_stops_with_the_step_and_saves_no_nan(tmp_path, shakespeare):
    r = run_cli("train.py", *args(tmp_path, shakespeare, "--optim.lr=1e30", "--optim.warmup_steps=0",
                                  "--optim.grad_clip=0"), devices=2)
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: training diverged at step ")
    assert "last good checkpoint" in last or "no checkpoint yet" in last
    diverged_at = int(last.split("step ")[1].split(" ")[0])
    saved = checkpoint_steps(tmp_path) if (tmp_path / "checkpoints").exists() else []
    assert all(s < diverged_at for s in saved)
    for step in saved:  # every checkpoint left behind evaluates to a finite loss
        e = run_cli("eval.py", "--run_dir", str(tmp_path), "--step", str(step), "--batches", "1", "--no-wandb",
                    devices=1)
        assert e.returncode == 0, e.stderr[-2000:]
        assert np.isfinite(json.loads((tmp_path / "eval.json").read_text())[str(step)]["val_loss"])


# ---- storage ------------------------------------------------------------------------------------


def test_full_disk_while_saving_is_a_clear_error_and_keeps_older_checkpoints(tmp_path, shakespeare):
    proc = start(tmp_path, shakespeare, "--checkpoint.async_save=False")
    wait_for(lambda: (tmp_path / "checkpoints").exists() and checkpoint_steps(tmp_path), proc)
    # from now on no file of this process may grow beyond 1 KB: the next save hits EFBIG, like a full disk
    subprocess.run(["prlimit", f"--pid={proc.pid}", "--fsize=1024"], check=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: could not save checkpoint") and "File too large" in last
    kept = checkpoint_steps(tmp_path)
    assert kept
    e = run_cli("eval.py", "--run_dir", str(tmp_path), "--step", str(kept[-1]), "--batches", "1", "--no-wandb",
                devices=1)
    assert e.returncode == 0, e.stderr[-2000:]


def test_unwritable_run_directory_is_one_line(tmp_path, shakespeare):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    r = run_cli("train.py", *args(blocker / "run", shakespeare), devices=1)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: cannot write the run directory {blocker / 'run'}")


# ---- device count changes -----------------------------------------------------------------------


@pytest.mark.parametrize("before, after", [(8, 2), (2, 8)])
def test_resume_on_another_device_count(tmp_path, shakespeare, reference, before, after):
    r = run_cli("train.py", *args(tmp_path, shakespeare, "--train.stop_after=6"), devices=before)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_cli("train.py", *args(tmp_path, shakespeare), devices=after)
    assert r.returncode == 0, r.stderr[-3000:]
    np.testing.assert_allclose(losses(tmp_path), reference, rtol=0, atol=1e-5)


# ---- bad input ----------------------------------------------------------------------------------


def _corpus(shakespeare, tmp_path, damage):
    d = tmp_path / "corpus"
    shutil.copytree(shakespeare, d)
    damage(d)
    return d


def _odd_bytes(d):
    with open(d / "train.bin", "ab") as f:
        f.write(b"\x00")


def _big_ids(d):
    (d / "train.bin").write_bytes(np.full(10_000, 65_000, dtype="<u2").tobytes())
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps({**meta, "train_files": ["train.bin"]}))


def _other_tokenizer(d):
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps({**meta, "tokenizer": "cl100k_base", "tokenizer_sha256": "0" * 64}))


def _empty(d):
    for f in d.iterdir():
        f.unlink()


@pytest.mark.parametrize(
    "damage, message",
    [
        (_odd_bytes, "train.bin: 2819995 bytes is not a whole number of uint16 tokens"),
        (_big_ids, "token id 65000"),
        (_other_tokenizer, "tokenized with 'cl100k_base'"),
        (_empty, "meta.json: missing"),
    ],
)
def test_bad_corpus_is_one_line(tmp_path, shakespeare, damage, message):
    corpus = _corpus(shakespeare, tmp_path, damage)
    run_dir = tmp_path / "run"
    r = run_cli("train.py", "--run_dir", str(run_dir), f"--data.dataset={corpus}", *FAULT, devices=1)
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, r.stderr[-2000:]


def test_bad_input_leaves_existing_run_data_untouched(tmp_path, shakespeare):
    r = run_cli("train.py", *args(tmp_path, shakespeare, "--train.stop_after=4"), devices=1)
    assert r.returncode == 0, r.stderr[-3000:]
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    for bad in (["--model.n_head=3"], ["--train.batch_size=7"], ["--mesh.rules=nope"], ["--model.n_embd=64"]):
        r = run_cli("train.py", *args(tmp_path, shakespeare, *bad), devices=2)
        assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: ")
    after = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before


def test_eval_errors_are_one_line(tmp_path, shakespeare):
    r = run_cli("eval.py", "--run_dir", str(tmp_path), devices=1)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == f"error: {tmp_path / 'checkpoints'}: no checkpoints to evaluate"
    t = run_cli("train.py", *args(tmp_path, shakespeare, "--train.stop_after=2"), devices=1)
    assert t.returncode == 0, t.stderr[-3000:]
    r = run_cli("eval.py", "--run_dir", str(tmp_path), "--batches", "1", "--no-wandb", "--prompt", " ".join(["word"] * 70),
                devices=1)
    assert r.returncode == 2
    assert "--prompt encodes to 70 tokens" in r.stderr.strip().splitlines()[-1]
    assert "exceeds the model's context of 64" in r.stderr.strip().splitlines()[-1]
