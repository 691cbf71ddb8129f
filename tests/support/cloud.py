"""A simulated cloud for tools.pod's tests: fake `gcloud`, `xpk`, `kubectl`, `sbatch`, `srun`, `squeue`, `sacct`,
`scancel`, `scontrol` executables on PATH that record every call and behave as the real tools' sources say where it
matters (docs/pods.md, "Checked against"), and hosts that are local processes, each with CPU devices, its own home
directory and what its real platform gives it (no PYTHONPATH to this checkout):

- TPU VMs (`gcloud compute tpus queued-resources create`): a metadata server per host (GCE_METADATA_IP) answering
  agent-worker-number, worker-network-endpoints and, for several slices, tpu-env's MEGASCALE_* lines: what JAX's
  GceTpuCluster reads. `tpu-vm ssh --worker=all` runs a command on every host of a slice at once, as gcloud's GA
  command does; `queued-resources ssh --node=all --worker=all` runs it in batches of --batch-size hosts (default
  64, or FAKE_CLOUD_SSH_BATCH), each batch waited for before the next and a failed batch ending it; a failed
  worker is named (`##### Command execution on worker N failed with exit status S. Continuing.`) and its status
  is gcloud's, as gcloud's tpu_vm/ssh.py does. `preempt` and `delete` kill everything on the VMs (also what was
  detached from the ssh). The zone's accelerator types and runtime versions answer `describe`; `log_out` makes
  every later gcloud call fail as a logged-out gcloud does.
- Their image (tests/support/fake_hosts/image.py): python3 3.10 without the venv module; uv from pip's user site;
  `fail_install` makes a host's package index fail once or always.
- GKE (tests/support/cloud_gke.py): regional clusters (a zonal credentials lookup answers 404), JobSet's restarts
  and its Completed on every pod exiting 0, xpk's restart exit codes; pods with TPU_WORKER_ID,
  TPU_WORKER_HOSTNAMES and, for several slices, MEGASCALE_*, as GKE sets them.
- Slurm (tests/support/cloud_slurm.py): sbatch on a site without select/cons_tres (--gres only), a task given one
  CPU and killed for memory unless the job asks for the node, squeue that forgets an ended job, sacct disabled;
  tasks with what JAX's SlurmCluster reads (tests/support/site/sitecustomize.py makes a node's GPUs CPU devices).

Where a real pod has one address per host and these share 127.0.0.1, a job's coordinator port is its own:
JAX_COORDINATOR_PORT (JAX's own override) on TPU hosts, a Slurm job id whose port (JAX: 61440 + id % 4096) is free.
JAX_FORCE_TPU_INIT makes JAX take a TPU host without chips for a Cloud TPU VM. `fail_next(n)` makes the next n
`describe` / `kubectl get` calls fail as a transient API error does.

    cloud = FakeCloud(tmp_path); env = cloud.env()   # PATH and FAKE_CLOUD_DIR for the launcher's subprocess
"""

from __future__ import annotations

import fcntl
import http.server
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
HOSTS = {"v4-16": 2, "v4-8": 1, "v5litepod-16": 4, "v5litepod-8": 1}  # accelerator type -> hosts (its own table)
CHIPS_PER_HOST = {"v4-16": 4, "v4-8": 4, "v5litepod-16": 4, "v5litepod-8": 8}
RUNTIMES = ("tpu-ubuntu2204-base", "v2-alpha-tpuv5", "v2-alpha-tpuv5-lite", "v2-alpha-tpuv6e")
TOOLS = {"gcloud": HERE / "cloud.py", "xpk": HERE / "cloud_gke.py", "kubectl": HERE / "cloud_gke.py",
         **{t: HERE / "cloud_slurm.py" for t in ("sbatch", "squeue", "sacct", "scancel", "srun", "scontrol")}}
SITE = HERE / "site"  # the sitecustomize of every process the tests start
LOGGED_OUT = """ERROR: ({}) You do not currently have an active account selected.
Please run:

  $ gcloud auth login

to obtain new credentials."""


class FakeCloud:
    def __init__(self, root: Path, devices_per_host: int | None = None, ssh_batch: int = 64,
                 clusters: dict[str, str] | None = None, accounting: bool = False):
        self.root = Path(root)
        self.devices_per_host = devices_per_host  # CPU devices per host (default: one per chip)
        self.ssh_batch = ssh_batch  # gcloud's default --batch-size
        self.bin = self.root / "bin"
        self.bin.mkdir(parents=True, exist_ok=True)
        for tool, program in TOOLS.items():
            _script(self.bin / tool, f'exec {sys.executable} {program} {tool} "$@"\n')
        self.image = self.root / "image"  # the VM image's own programs
        self.image.mkdir(exist_ok=True)
        _script(self.image / "python3", f'exec {sys.executable} {HERE / "fake_hosts" / "image.py"} python3 "$@"\n')
        # GKE clusters -> their location (xpk creates regional ones); Slurm's accounting (sacct) on or off
        (self.root / "clusters.json").write_text(json.dumps({"c": "us-west4"} if clusters is None else clusters))
        (self.root / "accounting").write_text("1" if accounting else "")

    def env(self, base: dict | None = None) -> dict:
        base = dict(os.environ if base is None else base)
        devices = {"FAKE_CLOUD_DEVICES": str(self.devices_per_host)} if self.devices_per_host else {}
        return {**base, "PATH": f"{self.bin}:{base['PATH']}", "FAKE_CLOUD_DIR": str(self.root),
                "FAKE_CLOUD_SSH_BATCH": str(self.ssh_batch), **devices}

    def calls(self) -> list[list[str]]:
        return [json.loads(line)["argv"] for line in _lines(self.root / "calls.jsonl")]

    def worker_runs(self) -> list[dict]:
        """Every command a host ran: {node, worker, command, slice (its creation), status}."""
        return [json.loads(line) for line in _lines(self.root / "workers.jsonl")]

    def state(self) -> dict:
        return _load(self.root)

    def fail_next(self, n: int) -> None:
        """The next n state reads (`queued-resources describe`, `kubectl get jobset`) fail as an API error does."""
        (self.root / "flaky").write_text(str(n))

    def log_out(self) -> None:
        """From now on every gcloud call fails as gcloud does without an active account (credentials/exceptions.py
        NoActiveAccountException)."""
        (self.root / "logged_out").touch()

    def fail_install(self, host: str, times: int = 1) -> None:
        """The package index fails `host`'s next `times` installs (-1: every one), as a 503 does."""
        path = self.root / "install_faults.json"
        faults = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**faults, host: times}))

    def preempt(self, name: str) -> None:
        with _locked(self.root) as state:
            state[name]["state"] = "SUSPENDED"
        _kill_vms(self.root, name)

    def kill_worker(self, name: str, worker: int) -> None:
        """Kills worker `worker`'s train.py (kill -9), the slice staying ACTIVE: a crashed process."""
        qr = self.state()[name]
        _kill_matching(f"FAKE_CLOUD_VM={name}-{qr['created']}/0/{worker}", "train.py")

    def close(self) -> None:
        """Kills every process of this cloud (its hosts, detached or not, and their metadata servers)."""
        _kill_matching(f"FAKE_CLOUD_ROOT={self.root}")


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


def _kill_matching(marker: str, in_command: str = "") -> None:
    """SIGKILL to every process whose environment holds `marker` (and whose command line `in_command`)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            found = marker.encode() in (proc / "environ").read_bytes().split(b"\0")
            if found and in_command.encode() in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:
            pass


def _kill_vms(root: Path, name: str) -> None:
    qr = _load(root).get(name)
    if qr is not None:
        for s in range(qr["slices"]):
            for w in range(qr["hosts"]):
                _kill_matching(f"FAKE_CLOUD_VM={name}-{qr['created']}/{s}/{w}")
        _kill_matching(f"FAKE_CLOUD_METADATA={name}-{qr['created']}")


def _flag(argv: list[str], name: str, default: str | None = None) -> str | None:
    for i, a in enumerate(argv):
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
        if a == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return default


def _free_port(low: int | None = None) -> int:
    """A port free now for a server that listens on it later (a job's coordinator, a metadata server): the first
    free one from `low`, else a random one below the kernel's ephemeral range. A port from bind(0) is an ephemeral
    one, which any outgoing connection on this machine may take as its own end meanwhile (the suite's workers make
    thousands), and a TPU VM's coordinator port serves every attempt on its slice."""
    if low is None:
        ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
        ephemeral_low = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
        candidates = random.Random().sample(range(10000, ephemeral_low), 200)
    else:
        candidates = range(low, 65536)
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def _transient_failure(root: Path, what: str) -> bool:
    """fail_next: an API error (a refused token refresh, a timeout) instead of an answer."""
    path = root / "flaky"
    with _locked(root):
        n = int(path.read_text()) if path.exists() else 0
        if n > 0:
            path.write_text(str(n - 1))
    if n > 0:
        print(f"ERROR: ({what}) There was a problem refreshing your current auth tokens: UNAVAILABLE: connection"
              " reset", file=sys.stderr)
    return n > 0


def _host_env(root: Path, home: Path, chips: int, **extra: str) -> dict:
    """A host's environment: none of this machine's JAX, TPU, Slurm or Python path settings (PYTHONPATH holds
    only the tests' sitecustomize)."""
    mine = ("JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS", "TPU_", "MEGASCALE_",
            "SLURM_", "FAKE_")  # (the JAX compilation cache stays shared, as the tests' other processes share it)
    env = {k: v for k, v in os.environ.items() if not k.startswith(mine) and k != "PYTHONPATH"}
    env.update(HOME=str(home), PATH=f"{root / 'image'}:{root / 'bin'}:{env['PATH']}", JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={os.environ.get('FAKE_CLOUD_DEVICES', chips)}",
               FAKE_CLOUD_ROOT=str(root), PYTHONPATH=str(SITE), **extra)
    return env


def _record(root: Path, **run) -> None:
    with open(root / "workers.jsonl", "a") as f:
        f.write(json.dumps(run) + "\n")


# ---- gcloud: queued resources, TPU VMs --------------------------------------------------------------


def gcloud(root: Path, argv: list[str]) -> int:
    words = [a for a in argv if not a.startswith("-")]
    if (root / "logged_out").exists():
        print(LOGGED_OUT.format("gcloud." + ".".join(words[:4])), file=sys.stderr)
        return 1
    if words[:2] == ["auth", "print-access-token"]:
        print("ya29.fake-token")
        return 0
    if words[:3] == ["compute", "tpus", "queued-resources"]:
        verbs = {"create": _create, "describe": _describe, "delete": _delete, "ssh": _qr_ssh}
        return verbs[words[3]](root, words[4], argv)
    if words[:4] == ["compute", "tpus", "tpu-vm", "ssh"]:
        return _tpu_vm_ssh(root, words[4], argv)
    if words[:3] == ["compute", "tpus", "tpu-vm"] and words[4:5] == ["describe"]:
        return _zone_offers(words[3], words[5])
    if words[:2] == ["container", "clusters"]:
        return _clusters(root, words[2], argv)
    print(f"fake gcloud: unsupported: {argv}", file=sys.stderr)
    return 2


def _zone_offers(kind: str, name: str) -> int:
    """`tpu-vm accelerator-types describe` / `tpu-vm versions describe`: the zone's own list."""
    if name in (HOSTS if kind == "accelerator-types" else RUNTIMES):
        print(name)
        return 0
    print(f"ERROR: (gcloud.compute.tpus.tpu-vm.{kind}.describe) NOT_FOUND: Resource '{name}' was not found",
          file=sys.stderr)
    return 1


def _clusters(root: Path, verb: str, argv: list[str]) -> int:
    """`container clusters list --filter=name=C` answers its location; `get-credentials C --zone/--location`
    finds it only at that location (a regional cluster asked for at a zone: 404, as the GKE API answers)."""
    clusters = json.loads((root / "clusters.json").read_text())
    if verb == "list":
        name = (_flag(argv, "filter") or "").removeprefix("name=")
        print("\n".join(loc for c, loc in clusters.items() if c == name))
        return 0
    name = [a for a in argv if not a.startswith("-")][3]
    asked = _flag(argv, "location") or _flag(argv, "zone") or _flag(argv, "region")
    if clusters.get(name) != asked:
        print(f"ERROR: (gcloud.container.clusters.get-credentials) ResponseError: code=404, message=Not found:"
              f" projects/{_flag(argv, 'project')}/locations/{asked}/clusters/{name}.", file=sys.stderr)
        return 1
    return 0


def _create(root: Path, name: str, argv: list[str]) -> int:
    kind, slices = _flag(argv, "accelerator-type"), int(_flag(argv, "node-count", "1"))
    with _locked(root) as state:
        if name in state:
            print(f"ERROR: (gcloud) queued resource {name} already exists", file=sys.stderr)
            return 1
        created = state["_created"] = state.get("_created", 0) + 1  # each creation: fresh hosts
        qr = state[name] = {"state": "ACTIVE", "slices": slices, "hosts": HOSTS[kind], "chips": CHIPS_PER_HOST[kind],
                            "port": _free_port(), "created": created}
        qr["metadata"] = [[_free_port() for _ in range(qr["hosts"])] for _ in range(slices)]
    env = {**os.environ, "FAKE_CLOUD_ROOT": str(root), "FAKE_CLOUD_METADATA": f"{name}-{created}"}
    subprocess.Popen([sys.executable, __file__, "_metadata", json.dumps(qr)], env=env, start_new_session=True,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # a real VM's metadata server answers before the VM does: without this wait a loaded machine started train.py
    # before its server listened, and JAX's TPU detection failed on "connection refused" (a flaky pod test)
    for port in (p for ports in qr["metadata"] for p in ports):
        _wait_listening(port)
    return 0


def _wait_listening(port: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _describe(root: Path, name: str, argv: list[str]) -> int:
    if _transient_failure(root, "gcloud.compute.tpus.queued-resources.describe"):
        return 1
    qr = _load(root).get(name)
    if qr is None:
        print(f"ERROR: (gcloud.compute.tpus.queued-resources.describe) NOT_FOUND: Resource"
              f" 'projects/p/locations/z/queuedResources/{name}' was not found", file=sys.stderr)
        return 1
    print(qr["state"])
    return 0


def _delete(root: Path, name: str, argv: list[str]) -> int:
    _kill_vms(root, name)
    with _locked(root) as state:
        qr = state.pop(name, None)
    if qr is None:
        print(f"ERROR: (gcloud) NOT_FOUND: {name}", file=sys.stderr)
        return 1
    return 0


def _tpu_vm_ssh(root: Path, node: str, argv: list[str]) -> int:
    """gcloud's GA `tpu-vm ssh`: every chosen worker of the node at once (no batches)."""
    qr = _load(root).get(node)
    if qr is None or qr["state"] != "ACTIVE" or qr["slices"] != 1:
        print(f"ERROR: (gcloud) {node} is not an ACTIVE TPU node", file=sys.stderr)
        return 1
    worker = _flag(argv, "worker", "0")
    workers = [(0, w) for w in (range(qr["hosts"]) if worker == "all" else [int(worker)])]
    return _run_batch(root, node, qr, workers, _flag(argv, "command"))


def _qr_ssh(root: Path, name: str, argv: list[str]) -> int:
    """`queued-resources ssh`: the chosen workers of the chosen nodes in batches of --batch-size, each batch
    waited for before the next; a batch with a failure ends it (tpu_vm/ssh.py WaitForBatchCompletion)."""
    qr = _load(root).get(name)
    if qr is None or qr["state"] != "ACTIVE":
        print(f"ERROR: (gcloud) {name} is not ACTIVE", file=sys.stderr)
        return 1
    node, worker = _flag(argv, "node", "0"), _flag(argv, "worker", "all")
    nodes = range(qr["slices"]) if node == "all" else [int(node)]
    targets = [(s, w) for s in nodes for w in (range(qr["hosts"]) if worker == "all" else [int(worker)])]
    batch = int(_flag(argv, "batch-size", os.environ.get("FAKE_CLOUD_SSH_BATCH", "64")))
    for i in range(0, len(targets), batch):
        code = _run_batch(root, name, qr, targets[i: i + batch], _flag(argv, "command"))
        if code:
            return code
    return 0


def _run_batch(root: Path, name: str, qr: dict, targets: list[tuple[int, int]], command: str) -> int:
    procs = []
    for s, w in targets:
        home = root / "vms" / f"{name}-{qr['created']}" / f"slice-{s}" / f"worker-{w}"
        home.mkdir(parents=True, exist_ok=True)
        env = _host_env(root, home, qr["chips"], HOSTNAME=f"{name}-{s}-w-{w}", JAX_FORCE_TPU_INIT="1",
                        FAKE_TPU_VM="1", JAX_COORDINATOR_PORT=str(qr["port"]),
                        GCE_METADATA_IP=f"127.0.0.1:{qr['metadata'][s][w]}",
                        FAKE_CLOUD_VM=f"{name}-{qr['created']}/{s}/{w}")
        procs.append(subprocess.Popen(["bash", "-c", command], cwd=home, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    codes = [_relay(p, f"{s}/{w}") for p, (s, w) in zip(procs, targets)]
    for (s, w), code in zip(targets, codes):
        _record(root, node=name, worker=w + s * qr["hosts"], command=command, slice=qr["created"], status=code)
        if code and len(targets) > 1:  # gcloud names each failed worker (its index on its node), then exits with
            # the first failure's status (tpu_vm/ssh.py AttemptRunWithRetries, WaitForBatchCompletion)
            print(f"##### Command execution on worker {w} failed with exit status {255 if code < 0 else code}."
                  " Continuing.", file=sys.stderr, flush=True)
    return next((255 if c < 0 else c for c in codes if c != 0), 0)  # ssh: 255 when the connection is lost


def _relay(p: subprocess.Popen, worker: str) -> int:
    for line in p.stdout:
        sys.stdout.write(f"[{worker}] {line}")
        sys.stdout.flush()
    return p.wait()


def metadata_server(qr: dict) -> None:
    """Each TPU VM's metadata server (computeMetadata/v1/instance/attributes/KEY), as its answers reach JAX."""
    hosts, slices = qr["hosts"], qr["slices"]
    for s in range(slices):
        for w in range(hosts):
            tpu_env = "".join(f"{k}: '{v}'\n" for k, v in (("MEGASCALE_COORDINATOR_ADDRESS", "127.0.0.1"),
                                                           ("MEGASCALE_NUM_SLICES", slices), ("MEGASCALE_SLICE_ID", s)))
            serve_metadata(qr["metadata"][s][w], {"agent-worker-number": str(w), "tpu-env": tpu_env if slices > 1
                                                  else "", "worker-network-endpoints": ",".join(["127.0.0.1"] * hosts)})
    threading.Event().wait()


def serve_metadata(port: int, answers: dict[str, str]) -> None:
    """A metadata server on 127.0.0.1:`port` answering `answers`, in a thread (GCE_METADATA_IP points JAX at it)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            key = self.path.rsplit("/", 1)[-1]
            found = self.headers.get("Metadata-Flavor") == "Google" and key in answers
            body = answers[key].encode() if found else b"not found"
            self.send_response(200 if found else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()


def record_call(root: Path, tool: str, argv: list[str]) -> None:
    with open(root / "calls.jsonl", "a") as f:
        f.write(json.dumps({"argv": [tool, *argv], "time": time.time()}) + "\n")


def cloud_root() -> Path:
    return Path(os.environ.get("FAKE_CLOUD_DIR") or os.environ.get("FAKE_CLOUD_ROOT", "."))


def main() -> int:
    tool, argv = sys.argv[1], sys.argv[2:]
    if tool == "_metadata":
        metadata_server(json.loads(argv[0]))
    record_call(cloud_root(), tool, argv)
    return gcloud(cloud_root(), argv)


def use(cloud: FakeCloud, monkeypatch) -> FakeCloud:
    """The fake tools on this process's PATH (for the launcher called in-process)."""
    monkeypatch.setenv("PATH", cloud.env()["PATH"])
    monkeypatch.setenv("FAKE_CLOUD_DIR", str(cloud.root))
    monkeypatch.setenv("FAKE_CLOUD_SSH_BATCH", str(cloud.ssh_batch))
    return cloud


if __name__ == "__main__":
    sys.exit(main())
