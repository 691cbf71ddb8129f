"""A host's place in the JAX job, from what its platform gives it, then the training command.

    python -m tools.pod.host -- python train.py ...

GKE (and the simulated pod in tests/fake_cloud.py) sets TPU_WORKER_ID and TPU_WORKER_HOSTNAMES, Slurm
SLURM_PROCID and SLURM_NTASKS (the batch script sets JAX_COORDINATOR_ADDRESS), a multislice job MEGASCALE_*. They
become JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, which train.py reads
(trainer/processes.py), with the same numbering as JAX's own cluster detection: slice by slice, worker by worker.
A TPU VM that sets none of them is left to that detection (its metadata server).
"""

from __future__ import annotations

import os
import sys

COORDINATOR_PORT = 8476  # JAX's port for its coordinator on Cloud TPU


def job_env(env: dict[str, str]) -> dict[str, str]:
    """The JAX_* variables for this host (empty where JAX's own detection knows the platform)."""
    if "JAX_COORDINATOR_ADDRESS" in env and "SLURM_PROCID" not in env:
        return {}  # set explicitly: kept
    if "SLURM_PROCID" in env:
        return {"JAX_PROCESS_ID": env["SLURM_PROCID"], "JAX_NUM_PROCESSES": env["SLURM_NTASKS"]}
    if "TPU_WORKER_ID" not in env:
        return {}
    hosts = env["TPU_WORKER_HOSTNAMES"].split(",")
    slices, slice_id = int(env.get("MEGASCALE_NUM_SLICES", "1")), int(env.get("MEGASCALE_SLICE_ID", "0"))
    head = env.get("MEGASCALE_COORDINATOR_ADDRESS", hosts[0]).split(":")[0] if slices > 1 else hosts[0]
    port = env.get("JAX_COORDINATOR_PORT", str(COORDINATOR_PORT))  # a simulated pod's hosts share one address
    return {"JAX_COORDINATOR_ADDRESS": f"{head}:{port}", "JAX_NUM_PROCESSES": str(slices * len(hosts)),
            "JAX_PROCESS_ID": str(slice_id * len(hosts) + int(env["TPU_WORKER_ID"]))}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[1:] if argv[:1] == ["--"] else argv
    if not command:
        print("error: give the command to run after --", file=sys.stderr)
        return 2
    os.execvpe(command[0], command, {**os.environ, **job_env(dict(os.environ))})


if __name__ == "__main__":
    sys.exit(main())
