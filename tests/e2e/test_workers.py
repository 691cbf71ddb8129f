"""No process outlives its trainer (data/orphans.py): a real train.py run with two Grain worker processes is killed
with SIGKILL (what the kernel's OOM killer sends) once its workers have fed it batches, and nothing it started — the
workers, multiprocessing's resource tracker — is left running. Linux: the processes are read from /proc. That the
workers go on after a resume's set_state: tests/unit/test_data.py. data/orphans.py's wait on its own, both ways (a
pidfd; polling, as on macOS): the last test."""

import os
import signal
import subprocess
import sys
import time

import pytest

from support.cli import ROOT, SMALL, cli_env

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads processes from /proc (Linux)")


def alive_in_session(session: int) -> dict[int, str]:
    """{pid: command line} of the running processes of a session (a zombie has ended: it only waits for whoever
    adopted it to reap it)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, _, _, sid = f.read().rsplit(")", 1)[1].split()[:4]
            with open(f"/proc/{pid}/cmdline") as f:
                command = f.read().replace("\0", " ").strip()
        except OSError:  # ended while we looked
            continue
        if int(sid) == session and state != "Z":
            found[int(pid)] = command
    return found


def logged_steps(run_dir) -> int:
    metrics = run_dir / "metrics.jsonl"
    return metrics.read_text().count('"loss"') if metrics.exists() else 0


def test_a_killed_trainer_leaves_no_worker_or_resource_tracker_running(tmp_path, shakespeare):
    run_dir = tmp_path / "run"
    with open(tmp_path / "stderr.txt", "w") as stderr:
        trainer = subprocess.Popen(  # in a session of its own: whatever it starts stays in that session
            [sys.executable, str(ROOT / "train.py"), "--run_dir", str(run_dir), f"--data.cache_dir={shakespeare}",
             *SMALL, "--train.steps=100000", "--train.eval_every=0", "--data.num_workers=2"],
            cwd=ROOT, env=cli_env(1), stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while logged_steps(run_dir) < 2:  # the workers have fed it batches
            assert trainer.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
            assert time.monotonic() < deadline, "no steps logged in 300 s"
            time.sleep(0.2)
        started = alive_in_session(trainer.pid)
        trainer.kill()
        trainer.wait()
        deadline = time.monotonic() + 5  # each gets that long to end
        while (left := alive_in_session(trainer.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for pid in alive_in_session(trainer.pid):  # never leave them to the rest of the suite
            os.kill(pid, signal.SIGKILL)
    assert len([c for c in started.values() if "multiprocessing.spawn" in c]) == 2, started  # the workers
    assert any("multiprocessing.resource_tracker" in c for c in started.values()), started
    assert not left, f"still running after the trainer was killed: {left}"


CHILD = """
import os, sys, time
if sys.argv[1] == "polling":
    del os.pidfd_open  # as on macOS
from data.orphans import end_with_parent
end_with_parent(os.getppid())
print("watching", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("wait", ["pidfd", "polling"])
def test_a_worker_ends_when_its_parent_is_killed_with_a_pidfd_or_by_polling_as_on_macos(wait):
    """data/orphans.py's two ways of waiting, each in a child of a process that is then killed with SIGKILL."""
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time;"
         f" child = subprocess.Popen([sys.executable, '-c', {CHILD!r}, {wait!r}]); print(child.pid, flush=True);"
         " time.sleep(60)"], cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        child = int(parent.stdout.readline())
        assert parent.stdout.readline() == "watching\n"  # the child's, on the pipe it inherited
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 5
        while child in alive_in_session(parent.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        ended_after = 5 - (deadline - time.monotonic())
    finally:
        for pid in alive_in_session(parent.pid):
            os.kill(pid, signal.SIGKILL)
    assert ended_after < 2.5, f"{wait}: the worker outlived its parent by {ended_after:.1f} s"  # polling: 0.5 s
