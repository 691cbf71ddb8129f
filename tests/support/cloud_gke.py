"""The simulated cloud's GKE (tests/support/cloud.py): fake `kubectl` and `xpk`, and the JobSet controller.

A JobSet's pods run in the background, each with what GKE gives a TPU pod (TPU_WORKER_ID, TPU_WORKER_HOSTNAMES,
MEGASCALE_* for several slices, the node's metadata server with an empty tpu-env). As JobSet does
(api/jobset/v1alpha2/jobset_types.go): when one pod fails, every pod of the set is stopped and, while
status.restarts < failurePolicy.maxRestarts, all are created again (fresh containers: the install runs again);
every pod exiting 0 makes the JobSet Completed (never restarted), running out of restarts Failed
(status.terminalState). xpk's JobSet adds its podFailurePolicy (commands/workload.py): a pod that fails with a
status outside 42, 127-255 and --restart-on-exit-codes fails the whole set at once. `xpk workload create` finds
the cluster as xpk does (its location from `gcloud container clusters list`): a cluster that does not exist
ends it before anything is created.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import cloud  # run as a script from tests/support (the fake executables)
from cloud import HOSTS, CHIPS_PER_HOST, _flag, _free_port, _host_env, _kill_matching, _locked, _record

STOP_GRACE_S = 5.0  # a deleted pod's SIGTERM grace here (the manifest's is minutes)


def _jobsets(root: Path) -> dict:
    path = root / "jobsets.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _set(root: Path, key: str, status: dict | None) -> None:
    with _locked(root):  # the same lock as the slices'
        jobsets = _jobsets(root)
        if status is None:
            jobsets.pop(key, None)
        else:
            jobsets[key] = status
        (root / "jobsets.json").write_text(json.dumps(jobsets))


def kubectl(root: Path, argv: list[str]) -> int:
    jobsets = _jobsets(root)
    if argv[:2] == ["get", "jobset"]:
        if cloud._transient_failure(root, "kubectl"):
            return 1
        if argv[2] not in jobsets:
            print(f'Error from server (NotFound): jobsets.jobset.x-k8s.io "{argv[2]}" not found', file=sys.stderr)
            return 1
        print(jobsets[argv[2]]["terminalState"], end="")
    elif argv[:2] == ["get", "jobsets.jobset.x-k8s.io"]:
        print("".join(f"jobset.jobset.x-k8s.io/{name}\n" for name in jobsets), end="")
    elif argv[:1] == ["apply"]:
        import yaml

        js = yaml.safe_load(Path(argv[-1]).read_text())
        rjob = js["spec"]["replicatedJobs"][0]
        pod = rjob["template"]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert pod.get("hostNetwork") is True  # a TPU pod: JAX's coordinator and the TPU runtime on the node
        _submit(root, {"key": js["metadata"]["name"], "hosts": rjob["template"]["spec"]["parallelism"],
                       "slices": rjob["replicas"], "chips": container["resources"]["limits"]["google.com/tpu"],
                       "command": container["command"][-1], "max_restarts": js["spec"]["failurePolicy"]["maxRestarts"],
                       "restart_on": None})
    elif argv[:2] == ["delete", "jobset"]:
        _delete(root, argv[2])
    return 0


def xpk(root: Path, argv: list[str]) -> int:
    if argv[:2] == ["workload", "create"]:
        clusters = json.loads((root / "clusters.json").read_text())
        if _flag(argv, "cluster") not in clusters:  # xpk's get-credentials at the region it guessed: 404
            print(f"[XPK] Task: `get-credentials-dns-endpoint to cluster {_flag(argv, 'cluster')}` terminated with"
                  " code `1`", file=sys.stderr)
            return 1
        kind = _flag(argv, "tpu-type")
        _submit(root, {"key": _flag(argv, "workload"), "hosts": HOSTS[kind], "chips": CHIPS_PER_HOST[kind],
                       "slices": int(_flag(argv, "num-slices", "1")), "command": _flag(argv, "command"),
                       "max_restarts": int(_flag(argv, "max-restarts", "0")),
                       "restart_on": sorted(_restart_codes(_flag(argv, "restart-on-exit-codes")))})
    elif argv[:2] == ["workload", "delete"]:
        _delete(root, _flag(argv, "workload"))
    return 0


def _restart_codes(extra: str | None) -> set[int]:
    """xpk's get_restart_exit_codes: 42 and 127-255, and the ranges and codes of --restart-on-exit-codes."""
    codes = {42, *range(127, 256)}
    for item in (extra or "").split(","):
        if "-" in item:
            low, high = map(int, item.split("-"))
            codes |= set(range(low, high + 1))
        elif item.strip():
            codes.add(int(item))
    return codes


def _submit(root: Path, spec: dict) -> None:
    _set(root, spec["key"], {"terminalState": "", "restarts": 0})
    env = {**os.environ, "FAKE_CLOUD_DIR": str(root), "FAKE_CLOUD_ROOT": str(root), "FAKE_CLOUD_JOBSET": spec["key"]}
    subprocess.Popen([sys.executable, __file__, "_jobset", json.dumps(spec)], env=env, start_new_session=True,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _delete(root: Path, key: str) -> None:
    _set(root, key, None)
    _kill_matching(f"FAKE_CLOUD_JOBSET={key}")


def controller(root: Path, spec: dict) -> int:
    """The JobSet's life: every pod, again after a failure while restarts are left."""
    restarts = 0
    while True:
        failed = _run_pods(root, spec)
        if failed is None:
            return _end(root, spec["key"], "Completed", restarts)
        if spec["key"] not in _jobsets(root):  # deleted
            return 0
        restart_on = spec["restart_on"]
        if (restart_on is not None and failed not in restart_on) or restarts >= spec["max_restarts"]:
            return _end(root, spec["key"], "Failed", restarts)
        restarts += 1
        _set(root, spec["key"], {"terminalState": "", "restarts": restarts})


def _end(root: Path, key: str, state: str, restarts: int) -> int:
    if key in _jobsets(root):  # not deleted meanwhile
        _set(root, key, {"terminalState": state, "restarts": restarts})
    return 0


def _run_pods(root: Path, spec: dict) -> int | None:
    """One attempt: a pod per host of every slice; the first failure's status once every pod has stopped (the
    others SIGTERMed, as JobSet deletes them), or None when every pod exited 0."""
    hosts, slices, port = spec["hosts"], spec["slices"], _free_port()
    run, procs = root / "pods" / f"{spec['key']}-{time.time_ns()}", []
    for i in range(hosts * slices):
        home = run / f"host-{i}"
        home.mkdir(parents=True)
        multislice = {"MEGASCALE_COORDINATOR_ADDRESS": "127.0.0.1", "MEGASCALE_NUM_SLICES": str(slices),
                      "MEGASCALE_SLICE_ID": str(i // hosts)} if slices > 1 else {}
        metadata = _free_port()  # a TPU pod with the node's network: its metadata server too (JAX reads tpu-env)
        cloud.serve_metadata(metadata, {"tpu-env": ""})
        env = _host_env(root, home, spec["chips"], TPU_WORKER_ID=str(i % hosts), JAX_FORCE_TPU_INIT="1",
                        TPU_WORKER_HOSTNAMES=",".join(["127.0.0.1"] * hosts), JAX_COORDINATOR_PORT=str(port),
                        GCE_METADATA_IP=f"127.0.0.1:{metadata}", HOSTNAME=f"{spec['key']}-{i}",
                        FAKE_CLOUD_JOBSET=spec["key"], **multislice)
        _record(root, node=spec["key"], worker=i, command=spec["command"], slice=port)
        with open(home / "out.log", "w") as log:
            procs.append(subprocess.Popen(["bash", "-c", spec["command"]], cwd=home, env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    while (codes := [p.poll() for p in procs]) and None in codes and not any(codes):
        time.sleep(0.05)
    failed = next((c for c in codes if c), None)
    if failed is not None:
        _stop(procs)
    else:
        [p.wait() for p in procs]
    return None if failed is None else (128 - failed if failed < 0 else failed)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.time() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


if __name__ == "__main__":
    tool, args = sys.argv[1], sys.argv[2:]
    root = cloud.cloud_root()
    if tool == "_jobset":
        sys.exit(controller(root, json.loads(args[0])))
    cloud.record_call(root, tool, args)
    sys.exit(kubectl(root, args) if tool == "kubectl" else xpk(root, args))
