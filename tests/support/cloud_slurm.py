"""The simulated cloud's Slurm (tests/support/cloud.py): fake `sbatch`, `srun`, `squeue`, `sacct`, `scancel`,
`scontrol`, as unkind as a site can be while following Slurm's sources (SchedMD/slurm):

- no select/cons_tres: a `--gpus*` request is rejected (doc/html/gres.shtml), `--gres=gpu:N` works;
- a task gets the CPUs its step asks for (`srun --cpus-per-task`, else 1: its affinity is cut to them), and its
  job's memory is DefMemPerCPU unless the job asks for the node (`--exclusive`, `--mem`): without, the task is
  OOM-killed at start-up (exit 137);
- squeue shows a job while it is pending or running and forgets it at its end (MinJobAge 0 here; a real
  slurmctld keeps it 300 s, shown with `--states=all`): then "Invalid job id specified" (src/squeue/squeue.c,
  print.c); sacct is disabled unless FakeCloud(accounting=True).

The batch script runs on "the first node" in the submit directory (sbatch's working directory, as SLURM_SUBMIT_DIR
is), its home its own; its srun starts one task per node there, with what JAX's SlurmCluster reads.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import cloud  # run as a script from tests/support (the fake executables)
from cloud import _host_env, _kill_matching, _locked, _record, _free_port

SLURM_PORTS = 61440  # JAX's Slurm coordinator port: 61440 + SLURM_JOB_ID % 4096 (jax/_src/clusters/slurm_cluster.py)
ACTIVE = ("PENDING", "RUNNING", "COMPLETING")
OOM = "slurmstepd: error: Detected 1 oom_kill event in StepId={}.0. Some of the step tasks have been OOM Killed."


def _jobs(root: Path) -> dict:
    path = root / "slurm.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _set(root: Path, job_id: str, state: str) -> None:
    with _locked(root):  # the same lock as the slices'
        jobs = _jobs(root)
        if jobs.get(job_id, {}).get("state") == "CANCELLED":
            return  # scancel's word stands
        jobs[job_id] = {"state": state, "ended": None if state in ACTIVE else time.time()}
        (root / "slurm.json").write_text(json.dumps(jobs))


def sbatch(root: Path, argv: list[str]) -> int:
    script = Path(argv[-1]).read_text()
    options = re.findall(r"^#SBATCH (\S+)", script, re.M)
    if any(o.startswith("--gpus") for o in options):  # select/cons_res: every --gpu* option is refused
        print("sbatch: error: Batch job submission failed: Invalid generic resource (gres) specification",
              file=sys.stderr)
        return 1
    gres = next((int(o.split(":")[-1]) for o in options if o.startswith("--gres=gpu")), 0)
    nodes = int(next(o.split("=")[1] for o in options if o.startswith("--nodes=")))
    whole = "--exclusive" in options
    port = _free_port(SLURM_PORTS)  # the job's id gives JAX's port: a free one
    job_id = str(port - SLURM_PORTS + 4096 * (1 + len(_jobs(root))))
    _set(root, job_id, "RUNNING")
    output = next((o.split("=", 1)[1] for o in options if o.startswith("--output=")), "slurm-%j.out")
    spec = {"id": job_id, "nodes": nodes, "gpus": gres, "script": argv[-1], "submit_dir": os.getcwd(),
            "output": output.replace("%j", job_id),
            "cpus": os.cpu_count() if whole else 1, "memory": whole or any(o.startswith("--mem") for o in options)}
    env = {**os.environ, "FAKE_CLOUD_DIR": str(root), "FAKE_CLOUD_ROOT": str(root)}
    subprocess.Popen([sys.executable, __file__, "_job", json.dumps(spec)], env=env, start_new_session=True,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(f"{job_id};fake-cluster")  # --parsable: ID[;cluster]
    return 0


def batch(root: Path, spec: dict) -> int:
    """The batch script on the first node, then the job's end state."""
    home = root / "nodes" / f"{spec['id']}-0"
    home.mkdir(parents=True)
    env = _host_env(root, home, spec["gpus"], SLURM_JOB_ID=spec["id"], SLURM_NNODES=str(spec["nodes"]),
                    SLURM_JOB_NODELIST=",".join(["localhost"] * spec["nodes"]), SLURM_SUBMIT_DIR=spec["submit_dir"],
                    SLURM_CPUS_ON_NODE=str(spec["cpus"]), FAKE_SLURM_MEMORY="1" if spec["memory"] else "")
    with open(Path(spec["submit_dir"]) / spec["output"], "w") as log:
        code = subprocess.run(["bash", spec["script"]], cwd=spec["submit_dir"], env=env, stdout=log,
                              stderr=subprocess.STDOUT, check=False).returncode
    _set(root, spec["id"], "COMPLETED" if code == 0 else "FAILED")
    return 0


def srun(root: Path, argv: list[str]) -> int:
    """One task per node of the job, as Slurm sets a task's variables, sharing the batch script's directory."""
    n, job_id = int(os.environ["SLURM_NNODES"]), os.environ["SLURM_JOB_ID"]
    command = argv[argv.index("-c") + 1]
    cpus = int(cloud._flag(argv, "cpus-per-task", "1"))
    if not os.environ.get("FAKE_SLURM_MEMORY"):  # DefMemPerCPU x 1 CPU: JAX's start-up alone exceeds it
        print(OOM.format(job_id), file=sys.stderr)
        return 137
    allowed = sorted(os.sched_getaffinity(0))[:cpus]
    procs = []
    for i in range(n):
        env = {**os.environ, "SLURM_PROCID": str(i), "SLURM_NTASKS": str(n), "SLURM_LOCALID": "0",
               "SLURM_NODEID": str(i), "SLURM_STEP_NODELIST": os.environ["SLURM_JOB_NODELIST"],
               "SLURM_STEP_NUM_NODES": str(n), "SLURM_STEP_NUM_TASKS": str(n), "SLURM_CPUS_PER_TASK": str(cpus),
               "FAKE_GPU_NODE": "1"}
        _record(root, node="srun", worker=i, command=command, slice=job_id, cpus=cpus)
        procs.append(subprocess.Popen(["bash", "-c", command], env=env,
                                      preexec_fn=lambda: os.sched_setaffinity(0, allowed)))
    return max(p.wait() for p in procs)


def squeue(root: Path, argv: list[str]) -> int:
    job_id = cloud._flag(argv, "jobs") or next(a[2:] or argv[i + 1] for i, a in enumerate(argv) if a.startswith("-j"))
    job = _jobs(root).get(job_id)
    if job is None or job["ended"] is not None:  # MinJobAge 0: forgotten at its end
        print("slurm_load_jobs error: Invalid job id specified", file=sys.stderr)
        return 1
    print(job["state"])
    return 0


def sacct(root: Path, argv: list[str]) -> int:
    if not (root / "accounting").read_text():
        print("sacct: error: Slurm accounting storage is disabled", file=sys.stderr)
        return 1
    job = _jobs(root).get(argv[argv.index("-j") + 1])
    print(job["state"] if job else "")
    return 0


def scancel(root: Path, argv: list[str]) -> int:
    _set(root, argv[0], "CANCELLED")
    _kill_matching(f"SLURM_JOB_ID={argv[0]}")
    return 0


def scontrol(root: Path, argv: list[str]) -> int:  # show hostnames NODELIST: every node is this machine
    print("\n".join(["localhost"] * int(os.environ.get("SLURM_NNODES", "1"))))
    return 0


if __name__ == "__main__":
    tool, args = sys.argv[1], sys.argv[2:]
    root = cloud.cloud_root()
    if tool == "_job":
        sys.exit(batch(root, json.loads(args[0])))
    cloud.record_call(root, tool, args)
    sys.exit({"sbatch": sbatch, "srun": srun, "squeue": squeue, "sacct": sacct, "scancel": scancel,
              "scontrol": scontrol}[tool](root, args))
