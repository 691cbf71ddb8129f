"""What the launcher's tests on the simulated cloud share (tests/e2e/test_pod*.py): the tiny repository its fast
tests' hosts clone (tools/pod/host.py and train.py's stand-in, tests/support/fake_hosts/fake_train.py), a Job for
it, the keep-alive in a thread, and what the fake tools saw."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from pathlib import Path

from support.cli import ROOT
from support.cloud import FakeCloud
from tools.pod.job import Job, Where
from tools.pod.keepalive import Keeper
from tools.pod.topology import parse_topology


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


def make_tiny_repo(repo: Path) -> tuple[Path, str]:
    """A repository holding this checkout's tools/pod/host.py and train.py's stand-in; (its path, its HEAD)."""
    (repo / "tools" / "pod").mkdir(parents=True)
    for init in ("tools/__init__.py", "tools/pod/__init__.py"):
        (repo / init).write_text("")
    shutil.copy(ROOT / "tools" / "pod" / "host.py", repo / "tools" / "pod" / "host.py")
    shutil.copy(ROOT / "tests" / "support" / "fake_hosts" / "fake_train.py", repo / "train.py")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "stand-in")
    return repo, git(repo, "rev-parse", "HEAD")


def tiny_job(tiny_repo, tmp_path: Path, target: str = "tpu-vm", retries: int = 1, topology: str = "",
             **kwargs) -> Job:
    """A one-host job (v4-8; gpu-1 for slurm; or `topology`) on the tiny repository, polled every 0.05 s, a failed
    step tried again after 0.05 s."""
    repo, commit = tiny_repo
    where = Where(target, "pod", "us-west4-a", "p", "c" if target in ("xpk", "jobset") else "", tmp_path / "w")
    (tmp_path / "run").mkdir(exist_ok=True)
    topology = parse_topology(topology or ("gpu-1" if target == "slurm" else "v4-8"), target, 1)
    return Job(where, topology, 1, str(tmp_path / "run"), str(repo), commit, (), retries=retries,
               poll_seconds=0.05, backoff_seconds=0.05, cluster_location="us-west4" if where.cluster else "",
               **kwargs)


def following(keeper: Keeper) -> tuple[threading.Thread, dict]:
    """keeper.follow() in a thread; its status lands in the dict."""
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", keeper.follow()), daemon=True)
    thread.start()
    return thread, result


def wait_for(condition, what: str, seconds: float = 60) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def console_tails(run_dir, chars: int = 2000) -> str:
    """The end of each host's console log (what its training printed): for the message of a failed assertion."""
    logs = sorted(Path(run_dir, "logs").glob("console.*.log"))
    return "".join(f"\n--- {p.name}:\n{p.read_text(errors='replace')[-chars:]}" for p in logs)


def verbs(cloud: FakeCloud) -> list[str]:
    return [" ".join(c[3:5]) if c[0] == "gcloud" else " ".join(c[:3]) for c in cloud.calls()]


def trained_on_every_host(cloud: FakeCloud, hosts: int) -> bool:
    """Whether, on every slice the cloud created, each of its hosts ran train.py."""
    runs = [r for r in cloud.worker_runs() if "train.py" in r["command"]]
    slices = {r["slice"] for r in runs}
    return bool(slices) and all({r["worker"] for r in runs if r["slice"] == s} == set(range(hosts)) for s in slices)
