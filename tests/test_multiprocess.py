"""Several JAX processes on this machine (CPU collectives over 127.0.0.1), as on a multi-host pod."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import train as train_app
from conftest import ROOT, SMALL, read_jsonl, run_main
from tools.launch import free_port

pytestmark = pytest.mark.slow

# The default end-of-run sample is on (it runs on every process: the parameters span them all).
COMMON = [*SMALL, "--train.steps=8", "--train.eval_every=4", "--checkpoint.every=4", "--mesh.fsdp=2",
          "--train.sample_tokens=12"]


def launch(run_dir, shakespeare, *extra, num_processes=2, devices=4, timeout=600):
    cmd = [sys.executable, "-m", "tools.launch", "--num_processes", str(num_processes), "--devices_per_process",
           str(devices), "--grace", "20", "--", sys.executable, "train.py", "--run_dir", str(run_dir),
           f"--data.cache_dir={shakespeare}", *COMMON, *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def losses(run_dir):
    return [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, shakespeare):
    run_dir = tmp_path_factory.mktemp("mp")
    r = launch(run_dir, shakespeare)
    assert r.returncode == 0, r.stdout[-3000:]
    return run_dir, r


def sample_of(output: str) -> str:
    text = output.replace("[p0] ", "")
    start = text.index("--- sample ---\n")
    return text[start:text.index("\n--------------\n", start)]


def test_two_processes_equal_one(two_process_run, shakespeare, tmp_path):
    run_dir, result = two_process_run
    code, out, err = run_main(train_app.main, "--run_dir", str(tmp_path), f"--data.cache_dir={shakespeare}", *COMMON)
    assert code == 0, err[-3000:]
    np.testing.assert_allclose(losses(run_dir), losses(tmp_path), rtol=0, atol=1e-5)
    assert len(losses(run_dir)) == 8
    # the default end-of-run sample: the same text from 2 processes as from 1, printed once
    assert sample_of(result.stdout) == sample_of(out) and "ROMEO:" in sample_of(out)
    assert result.stdout.count("--- sample ---") == 1
    # only process 0 reports: one parameter report, one set of metrics
    assert result.stdout.count("[p0] step 4: val_loss") == 1 and "[p1] step 4: val_loss" not in result.stdout
    assert "[p1] model    " not in result.stdout and "[p0] model    " in result.stdout  # the start-up summary
    # both processes wrote their own data-iterator state into the checkpoint
    data = sorted(p.name for p in (run_dir / "checkpoints" / "8" / "data").glob("process_*"))
    assert data == ["process_0-of-2.json", "process_1-of-2.json"]


def test_two_process_checkpoint_resumes_in_one_process_on_another_mesh(two_process_run, shakespeare, tmp_path):
    reference, _ = two_process_run
    first = launch(tmp_path, shakespeare, "--train.stop_after=4")
    assert first.returncode == 0, first.stdout[-3000:]
    code, out, err = run_main(train_app.main, "--run_dir", str(tmp_path), f"--data.cache_dir={shakespeare}", *COMMON,
                              "--mesh.fsdp=1", "--mesh.rules=dp")  # data 8: another mesh, replicated params
    assert code == 0, err[-3000:]
    assert "resumed from" in out
    np.testing.assert_allclose(losses(tmp_path), losses(reference), rtol=0, atol=1e-5)


def start_processes(run_dir, shakespeare, *extra, stderr=subprocess.PIPE):
    """Two train.py processes of one job started directly (no launcher to forward signals)."""
    port, procs = free_port(), []
    for pid in range(2):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
               "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(pid)}
        procs.append(subprocess.Popen(
            [sys.executable, "train.py", "--run_dir", str(run_dir), f"--data.cache_dir={shakespeare}", *COMMON,
             "--train.steps=400", "--train.eval_every=0", "--checkpoint.every=1000", "--train.sample_tokens=0",
             *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True))
    return procs


def wait_for_steps(run_dir, n, proc):
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= n):
        assert time.time() < deadline and proc.poll() is None, "training did not start"
        time.sleep(0.2)


def test_sigterm_to_one_process_saves_everywhere_at_one_step_and_resumes(two_process_run, shakespeare, tmp_path):
    """SIGTERM reaches process 1 only (a preempted host): JAX's preemption sync point makes both processes
    stop after the same call, save it together and exit 0."""
    procs = start_processes(tmp_path, shakespeare, stderr=subprocess.STDOUT)
    wait_for_steps(tmp_path, 4, procs[0])
    procs[1].send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    assert "stopped by SIGTERM at step" in outs[0]
    steps = [int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]
    assert len(steps) == 1 and 4 <= steps[0] < 400
    data = sorted(p.name for p in (tmp_path / "checkpoints" / str(steps[0]) / "data").glob("process_*"))
    assert data == ["process_0-of-2.json", "process_1-of-2.json"]
    # the restart (one process here, in-process: any process count resumes) continues from that step with the
    # losses of an uninterrupted run of as many steps (the 8-step 2-process run, or, when the signal landed
    # later, a 1-process run)
    total = max(8, steps[0] + 2)
    code, out, err = run_main(train_app.main, "--run_dir", str(tmp_path), f"--data.cache_dir={shakespeare}", *COMMON,
                              f"--train.steps={total}", "--train.sample_tokens=0")
    assert code == 0 and "resumed from" in out, err[-3000:]
    if total == 8:
        expected = losses(two_process_run[0])
    else:
        code, _, err = run_main(train_app.main, "--run_dir", str(tmp_path / "ref"), f"--data.cache_dir={shakespeare}",
                                *COMMON, f"--train.steps={total}", "--train.eval_every=0")
        assert code == 0, err[-3000:]
        expected = losses(tmp_path / "ref")
    np.testing.assert_allclose(losses(tmp_path), expected, rtol=0, atol=1e-5)


def test_a_dead_process_makes_the_others_fail_in_bounded_time(shakespeare, tmp_path):
    procs = start_processes(tmp_path, shakespeare, "--distributed.heartbeat_timeout_seconds=10")
    wait_for_steps(tmp_path, 2, procs[0])
    procs[1].kill()
    killed = time.time()
    try:
        procs[0].wait(timeout=120)
    finally:
        procs[0].kill()
    assert procs[0].returncode != 0
    assert time.time() - killed < 120
