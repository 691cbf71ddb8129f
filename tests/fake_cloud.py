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

HOSTS = {"v4-16": 2, "v4-8": 1, "v5litepod-16": 4, "v5litepod-8": 1}  # accelerator type -> hosts (its own table)
CHIPS_PER_HOST = {"v4-16": 4, "v4-8": 4, "v5litepod-16": 4, "v5litepod-8": 8}
TOOLS = ("gcloud", "xpk", "kubectl", "sbatch", "squeue", "sacct", "scancel", "srun", "scontrol")


class FakeCloud:
    def __init__(self, root: Path, devices_per_host: int | None = None):
        self.root = Path(root)
        self.devices_per_host = devices_per_host  # CPU devices per host (default: one per chip)
        self.bin = self.root / "bin"
        self.bin.mkdir(parents=True, exist_ok=True)
        for tool in TOOLS:
            _script(self.bin / tool, f'exec {sys.executable} {Path(__file__).resolve()} {tool} "$@"\n')
        self.image = self.root / "image"  # the VM image's own programs
        self.image.mkdir(exist_ok=True)
        _script(self.image / "python3", f'exec {sys.executable} {Path(__file__).resolve()} python3 "$@"\n')

    def env(self, base: dict | None = None) -> dict:
        base = dict(os.environ if base is None else base)
        devices = {"FAKE_CLOUD_DEVICES": str(self.devices_per_host)} if self.devices_per_host else {}
        return {**base, "PATH": f"{self.bin}:{base['PATH']}", "FAKE_CLOUD_DIR": str(self.root), **devices}

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


    def kill_worker(self, name: str, worker: int) -> None:
        """Kills one host's latest command (kill -9), the slice staying ACTIVE: a crashed process."""
        _kill_group(self.state()[name]["latest"][str(worker)])


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

    def __init__(self, root: Path, devices_per_host: int | None = None):
        self.root = Path(root)
        self.devices_per_host = devices_per_host  # CPU devices per host (default: one per chip)

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
        env = _host_env(root, home, qr["chips"])
        env.update(TPU_WORKER_ID=str(i), TPU_WORKER_HOSTNAMES=",".join(["127.0.0.1"] * qr["hosts"]),
                   JAX_COORDINATOR_PORT=str(qr["port"]))
        with open(root / "workers.jsonl", "a") as f:
            f.write(json.dumps({"node": node, "worker": i, "command": command, "slice": qr["created"]}) + "\n")
        procs.append(subprocess.Popen(["bash", "-c", command], cwd=home, env=env, start_new_session=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    with _locked(root) as state:
        if node in state:
            state[node]["pids"] += [p.pid for p in procs]
            state[node]["latest"] = {str(i): p.pid for i, p in zip(workers, procs)}  # this ssh's, by worker
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


# ---- GKE and Slurm: a submitted job's hosts run in the background; its state is kept in jobs.json ------


def _jobs(root: Path) -> dict:
    path = root / "jobs.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _set_job(root: Path, name: str, value: str) -> None:
    with _locked(root):  # the same lock as the slices'
        jobs = _jobs(root)
        jobs[name] = value
        (root / "jobs.json").write_text(json.dumps(jobs))


def _submit(root: Path, name: str, hosts: int, chips: int, command: str, kind: str) -> None:
    """Runs `command` on `hosts` local hosts in a detached process that records the job's end state."""
    _set_job(root, name, "RUNNING" if kind == "slurm" else "")
    spec = json.dumps({"name": name, "hosts": hosts, "chips": chips, "command": command, "kind": kind})
    subprocess.Popen([sys.executable, __file__, "_job", spec], env={**os.environ, "FAKE_CLOUD_DIR": str(root)},
                     start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _job(root: Path, spec: dict) -> int:
    """A job's hosts (GKE pods with TPU_WORKER_ID / TPU_WORKER_HOSTNAMES; Slurm's batch script, whose srun
    starts one task per node with SLURM_PROCID / SLURM_NTASKS), then its end state."""
    n, port = spec["hosts"], _free_port()
    slurm = spec["kind"] == "slurm"
    workers = [0] if slurm else list(range(n))  # slurm: the batch script on the first node; srun does the rest
    procs = []
    for i in workers:
        home = root / "pods" / f"{spec['name']}-{time.time_ns()}" / f"host-{i}"
        home.mkdir(parents=True)
        env = _host_env(root, home, spec["chips"])
        if slurm:
            env.update(SLURM_JOB_ID=str(port - 10000), SLURM_JOB_NODELIST=f"node[1-{n}]", SLURM_NNODES=str(n),
                       SLURM_SUBMIT_DIR=str(home))
        else:
            env.update(TPU_WORKER_ID=str(i), TPU_WORKER_HOSTNAMES=",".join(["127.0.0.1"] * n),
                       JAX_COORDINATOR_PORT=str(port))
            with open(root / "workers.jsonl", "a") as f:  # (slurm's tasks are recorded by srun)
                f.write(json.dumps({"node": spec["name"], "worker": i, "command": spec["command"], "slice": port})
                        + "\n")
        with open(home / "out.log", "w") as log:
            procs.append(subprocess.Popen(["bash", "-c", spec["command"]], cwd=home, env=env, stdout=log,
                                          stderr=subprocess.STDOUT))
    ok = all(p.wait() == 0 for p in procs)
    _set_job(root, spec["name"], ("COMPLETED" if ok else "FAILED") if slurm else ("Completed" if ok else "Failed"))
    return 0


def _host_env(root: Path, home: Path, chips: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FAKE_CLOUD_DIR")}
    env.update(HOME=str(home), PATH=f"{root / 'image'}:{root / 'bin'}:{env['PATH']}", JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={os.environ.get('FAKE_CLOUD_DEVICES', chips)}",
               FAKE_CLOUD_ROOT=str(root))
    return env


def srun(root: Path, argv: list[str]) -> int:
    """One task per node of the job, each with its SLURM_PROCID, sharing the batch script's directory."""
    n = int(os.environ["SLURM_NNODES"])
    command = argv[argv.index("-c") + 1]
    procs = []
    for i in range(n):
        env = {**os.environ, "SLURM_PROCID": str(i), "SLURM_NTASKS": str(n), "SLURM_NODEID": str(i)}
        with open(root / "workers.jsonl", "a") as f:
            f.write(json.dumps({"node": "srun", "worker": i, "command": command,
                                "slice": os.environ["SLURM_JOB_ID"]}) + "\n")
        procs.append(subprocess.Popen(["bash", "-c", command], env=env))
    return max(p.wait() for p in procs)


def gke_and_slurm(root: Path, tool: str, argv: list[str]) -> int:
    jobs = _jobs(root)
    if tool == "kubectl" and argv[:2] == ["get", "jobset"]:
        if argv[2] not in jobs:
            print(f'Error from server (NotFound): jobsets "{argv[2]}" not found', file=sys.stderr)
            return 1
        print(jobs[argv[2]], end="")
    elif tool == "kubectl" and argv[:1] == ["apply"]:
        import yaml

        js = yaml.safe_load(Path(argv[-1]).read_text())
        job = js["spec"]["replicatedJobs"][0]["template"]["spec"]
        container = job["template"]["spec"]["containers"][0]
        _submit(root, js["metadata"]["name"], job["parallelism"], container["resources"]["limits"]["google.com/tpu"],
                container["command"][-1], "gke")
    elif tool == "xpk" and argv[:2] == ["workload", "create"]:
        kind = _flag(argv, "tpu-type")
        _submit(root, _flag(argv, "workload"), HOSTS[kind], CHIPS_PER_HOST[kind], _flag(argv, "command"), "gke")
    elif tool == "sbatch":
        script = Path(argv[-1]).read_text()
        name = re.search(r"--job-name=(\S+)", script).group(1)
        nodes = int(re.search(r"--nodes=(\d+)", script).group(1))
        gpus = int(re.search(r"--gpus-per-node=(\d+)", script).group(1))
        _submit(root, name, nodes, gpus, script, "slurm")
        print(len(jobs) + 1)
    elif tool == "squeue":
        state = jobs.get(argv[argv.index("-n") + 1], "")
        print(state if state in ("RUNNING", "PENDING") else "", end="")
    elif tool == "sacct":
        print(jobs.get(_flag(argv, "name"), ""))
    elif tool == "scontrol":  # show hostnames NODELIST: every node is this machine
        print("\n".join(["127.0.0.1"] * int(os.environ.get("SLURM_NNODES", "1"))))
    elif tool in ("xpk", "kubectl", "scancel"):  # delete: forget the job
        jobs.pop(_flag(argv, "workload") or _flag(argv, "name") or argv[2], None)
        (root / "jobs.json").write_text(json.dumps(jobs))
    return 0


def main() -> int:
    tool, argv = sys.argv[1], sys.argv[2:]
    root = Path(os.environ.get("FAKE_CLOUD_DIR") or os.environ.get("FAKE_CLOUD_ROOT", "."))
    if tool == "python3":
        return python3(root, argv)
    if tool == "_job":
        return _job(root, json.loads(argv[0]))
    with open(root / "calls.jsonl", "a") as f:
        f.write(json.dumps({"argv": [tool, *argv], "time": time.time()}) + "\n")
    if tool == "srun":
        return srun(root, argv)
    return gcloud(root, argv) if tool == "gcloud" else gke_and_slurm(root, tool, argv)


if __name__ == "__main__":
    sys.exit(main())
