"""A simulated cloud for tools.pod's tests: fake `gcloud`, `xpk`, `kubectl`, `sbatch`, `squeue`, `sacct`,
`scancel` executables on PATH that record every call, and TPU VMs that are local processes.

`gcloud compute tpus queued-resources create` makes a slice whose hosts are directories (each host's home) and
a coordinator port; `tpu-vm ssh --worker=all --command=C` runs C with bash on every host at once, as a TPU VM
would: its own home, TPU_WORKER_ID / TPU_WORKER_HOSTNAMES (127.0.0.1 for each host), CPU devices (one per
chip) and no PYTHONPATH; without --worker=all only worker 0 runs it, as gcloud does. The VM image's `python3
-m venv` makes an environment whose python is this interpreter (the image has the packages: its pip records and
does nothing). `preempt` kills a slice's processes and marks it SUSPENDED, as a spot preemption does.

    cloud = FakeCloud(tmp_path); env = cloud.env()   # PATH and FAKE_CLOUD_DIR for the launcher's subprocess
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HOSTS = {"v4-16": 2, "v4-8": 1, "v5litepod-16": 4, "v5litepod-8": 1}  # accelerator type -> hosts
CHIPS_PER_HOST = {"v4-16": 4, "v4-8": 4, "v5litepod-16": 4, "v5litepod-8": 8}
TOOLS = ("gcloud", "xpk", "kubectl", "sbatch", "squeue", "sacct", "scancel")


class FakeCloud:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.bin = self.root / "bin"
        self.bin.mkdir(parents=True, exist_ok=True)
        for tool in TOOLS:
            _script(self.bin / tool, f'exec {sys.executable} {Path(__file__).resolve()} {tool} "$@"\n')
        self.image = self.root / "image"  # the VM image's own programs
        self.image.mkdir(exist_ok=True)
        _script(self.image / "python3", f'exec {sys.executable} {Path(__file__).resolve()} python3 "$@"\n')

    def env(self, base: dict | None = None) -> dict:
        base = dict(os.environ if base is None else base)
        return {**base, "PATH": f"{self.bin}:{base['PATH']}", "FAKE_CLOUD_DIR": str(self.root)}

    def calls(self) -> list[list[str]]:
        return [json.loads(line)["argv"] for line in _lines(self.root / "calls.jsonl")]

    def worker_runs(self) -> list[dict]:
        """Every command a host ran: {node, worker, command, slice (its creation number)}."""
        return [json.loads(line) for line in _lines(self.root / "workers.jsonl")]

    def state(self) -> dict:
        return _load(self.root)

    def preempt(self, name: str) -> None:
        with _locked(self.root) as state:
            qr = state[name]
            qr["state"] = "SUSPENDED"
            for pid in qr["pids"]:
                _kill_group(pid)


def _script(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _load(root: Path) -> dict:
    path = root / "state.json"
    return json.loads(path.read_text()) if path.exists() else {}


class _locked:
    """The cloud's state, read and written under a file lock (ssh sessions and the test change it at once)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def __enter__(self) -> dict:
        self.lock = open(self.root / "state.lock", "w")
        fcntl.flock(self.lock, fcntl.LOCK_EX)
        self.state = _load(self.root)
        return self.state

    def __exit__(self, *exc):
        (self.root / "state.json").write_text(json.dumps(self.state))
        self.lock.close()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _flag(argv: list[str], name: str, default: str | None = None) -> str | None:
    for i, a in enumerate(argv):
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
        if a == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return default


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- gcloud ------------------------------------------------------------------------------------------


def gcloud(root: Path, argv: list[str]) -> int:
    words = [a for a in argv if not a.startswith("-")]
    if words[:3] == ["compute", "tpus", "queued-resources"]:
        return {"create": _create, "describe": _describe, "delete": _delete}[words[3]](root, words[4], argv)
    if words[:4] == ["compute", "tpus", "tpu-vm", "ssh"]:
        return _ssh(root, words[4], argv)
    if words[:3] == ["container", "clusters", "get-credentials"]:
        return 0
    print(f"fake gcloud: unsupported: {argv}", file=sys.stderr)
    return 2


def _create(root: Path, name: str, argv: list[str]) -> int:
    kind = _flag(argv, "accelerator-type")
    with _locked(root) as state:
        if name in state:
            print(f"ERROR: (gcloud) queued resource {name} already exists", file=sys.stderr)
            return 1
        created = state["_created"] = state.get("_created", 0) + 1  # each creation: fresh hosts
        state[name] = {"state": "ACTIVE", "hosts": HOSTS[kind], "chips": CHIPS_PER_HOST[kind], "pids": [],
                       "port": _free_port(), "created": created}
    return 0


def _describe(root: Path, name: str, argv: list[str]) -> int:
    qr = _load(root).get(name)
    if qr is None:
        print(f"ERROR: (gcloud) NOT_FOUND: {name}", file=sys.stderr)
        return 1
    print(qr["state"])
    return 0


def _delete(root: Path, name: str, argv: list[str]) -> int:
    with _locked(root) as state:
        qr = state.pop(name, None)
    if qr is None:
        print(f"ERROR: (gcloud) NOT_FOUND: {name}", file=sys.stderr)
        return 1
    for pid in qr["pids"]:
        _kill_group(pid)
    return 0


def _ssh(root: Path, node: str, argv: list[str]) -> int:
    qr = _load(root).get(node)
    if qr is None or qr["state"] != "ACTIVE":
        print(f"ERROR: (gcloud) {node} is not ACTIVE", file=sys.stderr)
        return 1
    command, worker = _flag(argv, "command"), _flag(argv, "worker", "0")
    workers = range(qr["hosts"]) if worker == "all" else [int(worker)]
    procs = []
    for i in workers:
        home = root / "vms" / f"{node}-{qr['created']}" / f"worker-{i}"
        home.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FAKE_CLOUD_DIR")}
        env.update(HOME=str(home), PATH=f"{root / 'image'}:{env['PATH']}", TPU_WORKER_ID=str(i),
                   TPU_WORKER_HOSTNAMES=",".join(["127.0.0.1"] * qr["hosts"]), JAX_COORDINATOR_PORT=str(qr["port"]),
                   JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={qr['chips']}",
                   FAKE_CLOUD_ROOT=str(root))
        with open(root / "workers.jsonl", "a") as f:
            f.write(json.dumps({"node": node, "worker": i, "command": command, "slice": qr["created"]}) + "\n")
        procs.append(subprocess.Popen(["bash", "-c", command], cwd=home, env=env, start_new_session=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    with _locked(root) as state:
        if node in state:
            state[node]["pids"] += [p.pid for p in procs]
    codes = [_relay(p, i) for p, i in zip(procs, workers)]
    return next((255 if c < 0 else c for c in codes if c != 0), 0)  # ssh: 255 when the connection is lost


def _relay(p: subprocess.Popen, worker: int) -> int:
    for line in p.stdout:
        sys.stdout.write(f"[w{worker}] {line}")
        sys.stdout.flush()
    return p.wait()


# ---- the VM image's python3 ------------------------------------------------------------------------


def python3(root: Path, argv: list[str]) -> int:
    if argv[:2] == ["-m", "venv"]:
        venv = Path(argv[-1]) / "bin"
        venv.mkdir(parents=True, exist_ok=True)
        _script(venv / "python", f'exec {sys.executable} "$@"\n')
        _script(venv / "pip", f'echo "$@" >> {os.environ.get("FAKE_CLOUD_ROOT", ".")}/pip.log\n')
        return 0
    os.execv(sys.executable, [sys.executable, *argv])


# ---- GKE and Slurm: recorded; a submitted job is running until the test says otherwise --------------


def recorded(root: Path, tool: str, argv: list[str]) -> int:
    jobs = root / "jobs.json"
    state = json.loads(jobs.read_text()) if jobs.exists() else {}
    if tool == "kubectl" and argv[:2] == ["get", "jobset"]:
        if argv[2] not in state:
            return 1
        print(state[argv[2]], end="")
    elif tool == "squeue":
        name = _flag(argv, "n") or argv[argv.index("-n") + 1]
        print(state.get(name, ""))
    elif tool in ("xpk", "kubectl", "sbatch") and re.search(r"create|apply|parsable", " ".join(argv)):
        name = _flag(argv, "workload") or Path(argv[-1]).stem
        state[name] = "" if tool != "sbatch" else "RUNNING"
        print("1234" if tool == "sbatch" else "created")
    jobs.write_text(json.dumps(state))
    return 0


def main() -> int:
    tool, argv = sys.argv[1], sys.argv[2:]
    root = Path(os.environ.get("FAKE_CLOUD_DIR") or os.environ.get("FAKE_CLOUD_ROOT", "."))
    if tool == "python3":
        return python3(root, argv)
    with open(root / "calls.jsonl", "a") as f:
        f.write(json.dumps({"argv": [tool, *argv], "time": time.time()}) + "\n")
    return gcloud(root, argv) if tool == "gcloud" else recorded(root, tool, argv)


if __name__ == "__main__":
    sys.exit(main())
