"""Numerical safety in whole runs: a saved state is always finite, eval.py refuses non-finite results, the spike
guard skips outlier steps, and rollback restores and skips the data window, also after a kill.

The runs go through train.main / eval.main in-process on the embedded corpus, or a copy of it whose batches at known
steps are random token ids (a loss spike where the test chooses); only the kill needs a process of its own."""

import dataclasses
import json
import shutil
import signal
import subprocess
import sys
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
import eval as eval_app
import train as train_app
from configs.base import Config
from support.cli import ROOT, SMALL, checkpoint_steps, cli_env, last_line, read_jsonl, run_main, without_timing
from support.faults import nan_gradient_at
from trainer.program.mesh import make_mesh
from trainer.program.train_program import TrainProgram
from trainer.storage.checkpoints import Checkpoints
from trainer.telemetry import goodput


TINY = [*SMALL, "--train.steps=30", "--train.steps_per_call=5", "--checkpoint.every=5", "--optim.grad_clip=0",
        "--schedule.warmup_steps=0"]


def train(run_dir, shakespeare, *extra):
    return run_main(train_app.main, "--run_dir", str(run_dir), f"--data.cache_dir={shakespeare}", *TINY, *extra)


def evaluates_finite(run_dir) -> None:
    for step in checkpoint_steps(run_dir):
        code, _, err = run_main(eval_app.main, "--run_dir", str(run_dir), "--step", str(step), "--batches", "1",
                                "--no-wandb")
        assert code == 0, err[-2000:]


# whole runs through train.main
@pytest.mark.parametrize("extra, nan_at, saved", [
    (["--optim.lr=300"], None, []),  # the case: checkpoint 5 held NaN parameters
    (["--optim.lr=1e30", "--train.steps_per_call=1", "--checkpoint.every=1"], None, []),  # finite, then overflow
    (["--optim.lr=1e30", "--model.dtype=bfloat16", "--train.steps_per_call=1", "--checkpoint.every=1"], None, []),
    # the NaN reaches the state in the call of steps 7-9: checkpoints 3 and 6 only
    (["--optim.lr=1e-3", "--train.steps_per_call=3", "--checkpoint.every=3"], 8, [3, 6]),
], ids=["lr300", "lr1e30", "bf16-lr1e30", "nan-gradient"])
def test_a_diverging_run_leaves_only_finite_checkpoints(tmp_path, shakespeare, monkeypatch, extra, nan_at, saved):
    if nan_at is not None:
        nan_gradient_at(monkeypatch, nan_at)
    code, _, err = train(tmp_path, shakespeare, *extra)
    message = last_line(err)
    assert code == 2 and message.startswith("error: training diverged"), err[-2000:]
    assert (checkpoint_steps(tmp_path) if (tmp_path / "checkpoints").exists() else []) == saved
    newest = f"last good checkpoint: {tmp_path / 'checkpoints' / str(saved[-1])}" if saved else "no checkpoint yet"
    assert message.endswith(newest), message
    evaluates_finite(tmp_path)


def test_eval_refuses_non_finite_parameters_and_all_goes_on(tmp_path, shakespeare):
    """A checkpoint with a NaN parameter (written by hand: training no longer writes one) is one error line;
    --all evaluates the others, keeps their results and exits non-zero."""
    code, _, err = train(tmp_path, shakespeare, "--train.steps=10", "--optim.lr=1e-3")
    assert code == 0, err[-2000:]
    ckpt = Checkpoints(tmp_path, dataclasses.replace(Config().checkpoint, async_save=False))
    meta = ckpt.read_meta(10)
    trainer = TrainProgram.build(configs.from_dict(meta["config"]), make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    with jax.set_mesh(trainer.mesh):
        state = ckpt.restore(10, trainer.abstract_state())
        state["params"] = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.nan), state["params"])
        ckpt.save(15, state, None, meta)
        ckpt.wait()
    ckpt.close()
    code, _, err = run_main(eval_app.main, "--run_dir", str(tmp_path), "--step", "15", "--batches", "1", "--no-wandb")
    assert code == 2 and last_line(err) == (f"error: {tmp_path / 'checkpoints' / '15'}: its parameters are not"
                                            " finite (saved by a run that diverged); evaluate an earlier"
                                            f" checkpoint; checkpoints in this run: [5, 10, 15]"), err
    code, _, err = run_main(eval_app.main, "--run_dir", str(tmp_path), "--all", "--batches", "1", "--no-wandb")
    assert code == 2 and "1 of 3 checkpoints could not be evaluated (steps [15])" in err
    assert sorted(r["step"] for r in json.loads((tmp_path / "eval.json").read_text())["results"]) == [5, 10]


SPIKE = [*SMALL, "--train.steps=28", "--train.steps_per_call=4", "--checkpoint.every=8", "--checkpoint.keep=10",
         "--optim.lr=3e-3", "--guard.skip_spikes=True", "--guard.warmup=10", "--guard.z_loss=3"]


SPIKE_STEPS = (22, 23)  # every row of these steps' batches is random token ids


@pytest.fixture(scope="module")
def poisoned(shakespeare, tmp_path_factory):
    """A copy of the corpus whose training windows read at SPIKE_STEPS are random ids (the loss jumps from
    ~8.8 to ~10.9; the boundary token each window shares with the next is kept, so no other window changes)."""
    corpus = tmp_path_factory.mktemp("poisoned")
    for name in ("meta.json", "train.bin", "val.bin"):
        shutil.copy(shakespeare / name, corpus / name)
    T, B, seed = 32, 8, Config().data.seed
    tokens = np.memmap(corpus / "train.bin", dtype=np.uint16, mode="r+")
    order = grain.MapDataset.range((len(tokens) - 1) // T).shuffle(seed=seed)  # the loader's window order
    rng = np.random.default_rng(0)
    for step in SPIKE_STEPS:
        for i in range((step - 1) * B, step * B):
            w = order[i]
            tokens[w * T + 1 : w * T + T] = rng.integers(0, 50256, T - 1)
    tokens.flush()
    return corpus


def spike_run(run_dir, corpus, *extra):
    return run_main(train_app.main, "--run_dir", str(run_dir), f"--data.dataset={corpus}", *SPIKE, *extra)


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r}


def test_the_guard_skips_exactly_the_planted_spike(tmp_path, shakespeare, poisoned):
    code, _, err = spike_run(tmp_path / "clean", shakespeare)
    assert code == 0, err[-2000:]
    code, out, err = spike_run(tmp_path / "spiked", poisoned)
    assert code == 0, err[-2000:]
    records = [r for r in read_jsonl(tmp_path / "spiked" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records if r["skipped"]] == list(SPIKE_STEPS)
    assert all(f"step {s}: update skipped by the spike guard" in out + err for s in SPIKE_STEPS)
    clean, spiked = losses(tmp_path / "clean"), losses(tmp_path / "spiked")
    assert all(clean[s] == spiked[s] for s in range(1, SPIKE_STEPS[0]))  # bitwise until the spike
    # two updates fewer while the loss still falls ~0.1 per step: within 0.3 of the clean run (measured 0.12-0.24)
    assert max(abs(spiked[s] - clean[s]) for s in range(SPIKE_STEPS[-1] + 1, 29)) <= 0.3


ROLLBACK = ["--guard.rollback_after=2", "--guard.rollback_skip=3"]


def test_rollback_restores_the_checkpoint_and_skips_the_window_and_resumes_exactly_after_a_kill(
        tmp_path, poisoned):
    """Two skips in a row at steps 22-23 roll back to checkpoint 16; the data moves past the call's batches
    (steps 21-24) and 3 more. A kill -9 after the rollback and a restart reproduce the uninterrupted run."""
    code, out, err = spike_run(tmp_path / "whole", poisoned, *ROLLBACK)
    assert code == 0, err[-2000:]
    assert "the spike guard skipped 2 steps in a row (steps 22-23); rolled back to" in out + err
    records = read_jsonl(tmp_path / "whole" / "metrics.jsonl")
    rollback = [r for r in records if "rollback" in r]
    assert [(r["step"], r["rollback"], r["abandoned"]) for r in rollback] == [(16, 1, [17, 24])]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 29))  # the file keeps one trajectory
    assert not any(r.get("skipped") for r in records)  # the planted batches were never read again
    report = goodput.report(read_jsonl(tmp_path / "whole" / "events.jsonl"))
    assert report.lost_steps == 8 and report.seconds["rollback"] > 0  # the abandoned steps 17-24

    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "train.py", "--run_dir", str(killed), f"--data.dataset={poisoned}",
                             *SPIKE, *ROLLBACK], cwd=ROOT, env=cli_env(8), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = killed / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and '"rollback"' in metrics.read_text()):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    code, _, err = spike_run(killed, poisoned, *ROLLBACK)
    assert code == 0, err[-2000:]
    assert without_timing(read_jsonl(metrics)) == without_timing(records)
