"""The commands and files each target needs, as the launcher runs them and `--dry_run` prints them.

tpu-vm: a queued resource (one slice, or `--node-count` slices), then `tpu-vm ssh --worker=all` for the install
and for training (the same command on every host). xpk: `xpk workload create`. jobset: a JobSet manifest for
`kubectl apply -f`. slurm: an sbatch script, one task per node. Each is a `Plan`; `state_of` reads what its
`state` command prints.
"""

from __future__ import annotations

import dataclasses
import json
import shlex

from tools.pod.job import RUNTIME_VERSIONS, Job, Where

TARGETS = ("tpu-vm", "xpk", "jobset", "slurm")
RUNNING, PENDING, DONE, FAILED, GONE = "running", "pending", "done", "failed", "gone"


@dataclasses.dataclass(frozen=True)
class Plan:
    files: dict[str, str]  # name under the job's workdir -> text (a manifest, a batch script)
    create: tuple[str, ...]  # run in order before the job starts; each must succeed
    ready: str | None  # polled until state_of says running (tpu-vm: the queued resource is ACTIVE)
    install: tuple[str, ...]  # tpu-vm: the install on every host
    start: tuple[str, ...]  # tpu-vm: the training, one long command per slice; else: submits and returns


def q(text: str) -> str:
    return shlex.quote(text)


def plan(job: Job) -> Plan:
    return {"tpu-vm": _tpu_vm, "xpk": _xpk, "jobset": _jobset, "slurm": _slurm}[job.where.target](job)


def state_command(w: Where) -> str:
    """Prints the job's state (see `state_of`)."""
    if w.target == "tpu-vm":
        return f"gcloud compute tpus queued-resources describe {w.name} {_gcloud_where(w)} --format='value(state.state)'"
    if w.target == "slurm":  # squeue while it is queued or running, sacct afterwards
        return (f"squeue -h -n {w.name} -o %T | grep . || sacct -n -X -P --name={w.name} -o State | tail -n1")
    return f"kubectl get jobset {w.name} -o jsonpath='{{.status.terminalState}}'"


def state_of(target: str, rc: int, out: str) -> str:
    """The job's state from its state command's exit status and output."""
    word = out.strip().split()[0].upper() if out.strip() else ""
    if target == "tpu-vm":  # a queued resource: ACTIVE, or on its way, or preempted / failed / deleted
        if rc != 0 or word in ("SUSPENDING", "SUSPENDED", "FAILED", "DELETING", ""):
            return GONE
        return RUNNING if word == "ACTIVE" else PENDING
    if target == "slurm":
        return {"RUNNING": RUNNING, "PENDING": PENDING, "COMPLETING": RUNNING, "CONFIGURING": PENDING,
                "COMPLETED": DONE}.get(word, GONE if rc != 0 or not word else FAILED)
    if rc != 0:  # no such JobSet
        return GONE
    return {"": RUNNING, "COMPLETED": DONE}.get(word, FAILED)


def delete_commands(w: Where) -> tuple[str, ...]:
    if w.target == "tpu-vm":
        return (f"gcloud compute tpus queued-resources delete {w.name} {_gcloud_where(w)} --force --quiet",)
    if w.target == "xpk":
        return (f"xpk workload delete --workload={w.name} --cluster={w.cluster} {_gcloud_where(w)}",)
    if w.target == "jobset":
        return (f"kubectl delete jobset {w.name} --ignore-not-found",)
    return (f"scancel --name={w.name}",)


def _gcloud_where(w: Where) -> str:
    return f"--zone={w.zone} --project={w.project}"


# ---- tpu-vm ----------------------------------------------------------------------------------------


def _tpu_vm(job: Job) -> Plan:
    w, s = job.where, job.slice
    runtime = job.runtime_version or RUNTIME_VERSIONS[s.generation]
    nodes = f"--node-id={w.name}" if job.num_slices == 1 else f"--node-count={job.num_slices} --node-prefix={w.name}"
    create = (f"gcloud compute tpus queued-resources create {w.name} {nodes} {_gcloud_where(w)}"
              f" --accelerator-type={s.accelerator_type} --runtime-version={runtime}{' --spot' if job.spot else ''}")
    return Plan(files={}, create=(create,), ready=state_command(w), install=(_ssh(job, job.install_command()),),
                start=(_ssh(job, job.train_command()),))


def _ssh(job: Job, command: str) -> str:
    """The command on every host at once (--worker=all; the ssh ends when all of them have). Several slices:
    the queued resource's ssh reaches every node (--node=all), and each VM's TPU environment tells JAX its
    slice (the MEGASCALE_* settings), so the command is the same everywhere."""
    w = job.where
    if job.num_slices == 1:
        return f"gcloud compute tpus tpu-vm ssh {w.name} {_gcloud_where(w)} --worker=all --command={q(command)}"
    return (f"gcloud compute tpus queued-resources ssh {w.name} {_gcloud_where(w)} --node=all --worker=all"
            f" --command={q(command)}")


# ---- xpk and jobset (GKE) ---------------------------------------------------------------------------


def _credentials(w: Where) -> str:
    return f"gcloud container clusters get-credentials {w.cluster} {_gcloud_where(w)}"


def _xpk(job: Job) -> Plan:
    w = job.where  # xpk sets the MEGASCALE_* variables of a multislice workload itself
    create = (f"xpk workload create --workload={w.name} --cluster={w.cluster} {_gcloud_where(w)}"
              f" --tpu-type={job.slice.accelerator_type} --num-slices={job.num_slices}"
              f" --docker-image={job.image} --max-restarts={job.retries} --command={q(job.start_command())}")
    return Plan(files={}, create=(_credentials(w),), ready=None, install=(), start=(create,))


def _jobset(job: Job) -> Plan:
    manifest = f"{job.name}.yaml"
    credentials = (_credentials(job.where),) if job.where.cluster else ()  # else: kubectl's current context
    return Plan(files={manifest: jobset_manifest(job)}, create=credentials, ready=None, install=(),
                start=(f"kubectl apply -f {q(str(job.workdir / manifest))}",))


def jobset_manifest(job: Job) -> str:
    """One replicated Job per slice, one pod per host; GKE gives each pod TPU_WORKER_ID and
    TPU_WORKER_HOSTNAMES. JobSet restarts the whole set (up to --retries times) when a pod fails."""
    s, n = job.slice, job.name
    env = "" if job.num_slices == 1 else f"""
              env:
              - {{name: MEGASCALE_COORDINATOR_ADDRESS, value: "{n}-slice-0-0.{n}"}}
              - {{name: MEGASCALE_NUM_SLICES, value: "{job.num_slices}"}}
              - name: MEGASCALE_SLICE_ID
                valueFrom: {{fieldRef: {{fieldPath: "metadata.annotations['jobset.sigs.k8s.io/job-index']"}}}}"""
    return f"""apiVersion: jobset.x-k8s.io/v1alpha2
kind: JobSet
metadata:
  name: {n}
  annotations:
    alpha.jobset.sigs.k8s.io/exclusive-topology: cloud.google.com/gke-nodepool  # one slice per node pool
spec:
  failurePolicy:
    maxRestarts: {job.retries}
  replicatedJobs:
  - name: slice
    replicas: {job.num_slices}
    template:
      spec:
        parallelism: {s.hosts}
        completions: {s.hosts}
        completionMode: Indexed
        backoffLimit: 0
        template:
          spec:
            restartPolicy: Never
            nodeSelector:
              cloud.google.com/gke-tpu-accelerator: {s.gke_accelerator}
              cloud.google.com/gke-tpu-topology: {s.shape}
            containers:
            - name: train
              image: {job.image}
              command: ["bash", "-c", {json.dumps(job.start_command())}]
              securityContext: {{privileged: true}}
              resources:
                limits: {{google.com/tpu: {s.chips_per_host}}}{env}
"""


# ---- slurm -------------------------------------------------------------------------------------------


def _slurm(job: Job) -> Plan:
    script = f"{job.name}.sbatch"
    return Plan(files={script: sbatch_script(job)}, create=(), ready=None, install=(),
                start=(f"sbatch --parsable {q(str(job.workdir / script))}",))


def sbatch_script(job: Job) -> str:
    """Installs once into the submit directory (a filesystem every node mounts), then one task per node."""
    s = job.slice
    return f"""#!/bin/bash
#SBATCH --job-name={job.name}
#SBATCH --nodes={s.hosts}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={s.chips_per_host}
#SBATCH --output={job.name}-%j.log
cd "$SLURM_SUBMIT_DIR"
( {job.install_command()} ) || exit 1
# the first node coordinates, on a port of this job's own (two jobs may share a node)
export JAX_COORDINATOR_ADDRESS=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1):$((10000 + SLURM_JOB_ID % 50000))
srun --ntasks-per-node=1 bash -c {q(job.train_command())}
"""
