"""Two train.py processes of one job on this machine (CPU collectives over 127.0.0.1), started directly or through
tools.launch, and what they leave: the small run both e2e files of processes share (tests/e2e/test_multiprocess.py,
tests/e2e/test_stalls.py)."""

import os
import subprocess
import sys
import time

from support.cli import ROOT, SMALL, read_jsonl
from tools.launch import free_port

# The default end-of-run sample is on (it runs on every process: the parameters span them all).
COMMON = [*SMALL, "--train.steps=8", "--train.eval_every=4", "--checkpoint.every=4", "--mesh.fsdp=2",
          "--train.sample_tokens=12"]


def losses(run_dir):
    return [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


def start_processes(run_dir, shakespeare, *extra, stderr=subprocess.PIPE, env=None, program="train.py"):
    """Two train.py processes (or `program`'s, which runs train.py) of one job started directly (no launcher to
    forward signals)."""
    port, procs, extra_env = free_port(), [], env or {}
    for pid in range(2):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
               "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(pid),
               **extra_env}
        procs.append(subprocess.Popen(
            [sys.executable, str(program), "--run_dir", str(run_dir), f"--data.cache_dir={shakespeare}", *COMMON,
             "--train.steps=400", "--train.eval_every=0", "--checkpoint.every=1000", "--train.sample_tokens=0",
             *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True))
    return procs


def wait_for_steps(run_dir, n, proc):
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= n):
        assert time.time() < deadline and proc.poll() is None, "training did not start"
        time.sleep(0.2)


def checkpoints_of(run_dir):
    ckpt = run_dir / "checkpoints"
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) if ckpt.exists() else []


def end_both(procs, timeout=60):
    """(stderr of each, seconds from the first exit to the last) once both processes have ended."""
    ended, deadline = {}, time.time() + timeout
    while len(ended) < 2 and time.time() < deadline:
        for i, p in enumerate(procs):
            if i not in ended and p.poll() is not None:
                ended[i] = time.time()
        time.sleep(0.05)
    for p in procs:
        p.kill()
    errs = [p.communicate()[1] for p in procs]
    assert len(ended) == 2, f"not every process ended within {timeout} s:\n" + "\n".join(e[-2000:] for e in errs)
    return errs, max(ended.values()) - min(ended.values())

