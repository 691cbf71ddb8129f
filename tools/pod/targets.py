"""The commands and files each target needs, as the launcher runs them and `--dry_run` prints them, and how each
target's own answers read as a job's state.

tpu-vm: a queued resource (one slice, or `--node-count` slices), the install over `ssh --worker=all`, then the
training started detached on every host (tools/pod/host.py) so that it outlives the ssh session; the keep-alive
reads the queued resource's state and, while it is ACTIVE, process 0's host's record of the training. xpk: `xpk
workload create`. jobset: a JobSet manifest for `kubectl apply -f`. slurm: an sbatch script, one task per node.

Who relaunches (one owner per target): the launcher for tpu-vm and slurm (`--retries`); for xpk and jobset JobSet
itself (its failurePolicy.maxRestarts is `--retries`), the launcher only follows it.
"""

from __future__ import annotations

import dataclasses
import json
import shlex

from tools.pod.job import CHECKOUT, RUNTIME_VERSIONS, Job, Where

TARGETS = ("tpu-vm", "xpk", "jobset", "slurm")
RUNNING, PENDING, DONE, FAILED, GONE, UNKNOWN = "running", "pending", "done", "failed", "gone", "unknown"
# A pod's SIGTERM grace (JobSet's terminationGracePeriodSeconds, xpk's flag): the trainer saves a checkpoint
# when SIGTERM comes (trainer/run/preemption.py): one train call plus a save. Kubernetes' default is 30 s.
SIGTERM_GRACE_S = 120
RESTART_ON_EXIT_CODES = "1-2"  # xpk restarts on 42 and 127-255 only; the trainer's errors exit 1 or 2 (and a
# process that a peer's failure ends exits 2), so without these a failure would end the JobSet, not restart it


@dataclasses.dataclass(frozen=True)
class Plan:
    files: dict[str, str]  # name under the job's workdir -> text (a manifest, a batch script)
    create: tuple[str, ...]  # run in order before the job starts; each must succeed
    ready: bool  # tpu-vm: wait until the queued resource is ACTIVE before the install
    install: tuple[str, ...]  # tpu-vm: the install on every host
    start: tuple[str, ...]  # starts the training and returns (tpu-vm: detached on every host; else a submission)
    stop: tuple[str, ...]  # tpu-vm: ends what is left of an attempt on every host, before a restart there
    relaunches: bool  # the launcher relaunches (tpu-vm, slurm); else JobSet restarts the job itself


def q(text: str) -> str:
    return shlex.quote(text)


def plan(job: Job) -> Plan:
    return {"tpu-vm": _tpu_vm, "xpk": _xpk, "jobset": _jobset, "slurm": _slurm}[job.where.target](job)


def state_command(w: Where) -> str:
    """Prints the state of the job's resource (see `state_of`)."""
    if w.target == "tpu-vm":
        return (f"gcloud compute tpus queued-resources describe {w.name} {_gcloud_where(w)}"
                " --format='value(state.state)'")
    if w.target == "slurm":  # squeue while Slurm still lists the job, sacct (its accounting) afterwards
        job_id = f"$(cat {q(str(_job_id_file(w)))})"
        return f"squeue -h -j {job_id} -o %T 2>/dev/null | grep . || sacct -n -X -P -j {job_id} -o State"
    return f"kubectl get jobset {w.name} -o jsonpath='{{.status.terminalState}}'"


def state_of(target: str, rc: int, out: str, err: str = "") -> str:
    """The job's state from its state command's exit status and output. A failed command is UNKNOWN (an API or
    network error says nothing about the job), except the answer that the resource does not exist."""
    word = out.strip().split()[0].upper() if out.strip() else ""
    if target == "tpu-vm":  # a queued resource: ACTIVE, on its way, or preempted / failed / being deleted
        if rc != 0:
            return GONE if "NOT_FOUND" in err else UNKNOWN
        if word in ("SUSPENDING", "SUSPENDED", "FAILED", "DELETING"):
            return GONE
        return {"ACTIVE": RUNNING, "": UNKNOWN}.get(word, PENDING)
    if target == "slurm":
        if rc != 0 or not word:  # slurmctld and slurmdbd unreachable, or the job not yet in the accounting
            return UNKNOWN
        return {"RUNNING": RUNNING, "COMPLETING": RUNNING, "PENDING": PENDING, "CONFIGURING": PENDING,
                "REQUEUED": PENDING, "COMPLETED": DONE}.get(word, FAILED)
    if rc != 0:  # kubectl: "Error from server (NotFound)" for a JobSet that does not exist
        return GONE if "(NotFound)" in err else UNKNOWN
    return {"": RUNNING, "COMPLETED": DONE}.get(word, FAILED)  # JobSet's terminalState: Completed or Failed


def job_state_of(rc: int, out: str) -> str:
    """tpu-vm: the training's state from `python -m tools.pod.host state` on process 0's host."""
    word = out.strip().split()[-1] if rc == 0 and out.strip() else ""
    return {"": UNKNOWN, "running": RUNNING, "0": DONE}.get(word, FAILED)  # FAILED: an exit status, lost, none


def delete_commands(w: Where) -> tuple[str, ...]:
    if w.target == "tpu-vm":
        return (f"gcloud compute tpus queued-resources delete {w.name} {_gcloud_where(w)} --force --quiet",)
    if w.target == "xpk":
        return (f"xpk workload delete --workload={w.name} --cluster={w.cluster} {_gcloud_where(w)}",)
    if w.target == "jobset":
        return (f"kubectl delete jobset {w.name} --ignore-not-found",)
    return (f"scancel $(cat {q(str(_job_id_file(w)))})",)


def _gcloud_where(w: Where) -> str:
    return f"--zone={w.zone} --project={w.project}"


# ---- tpu-vm ----------------------------------------------------------------------------------------


def _tpu_vm(job: Job) -> Plan:
    w, s = job.where, job.slice
    runtime = job.runtime_version or RUNTIME_VERSIONS[s.generation]
    nodes = f"--node-id={w.name}" if job.num_slices == 1 else f"--node-count={job.num_slices} --node-prefix={w.name}"
    create = (f"gcloud compute tpus queued-resources create {w.name} {nodes} {_gcloud_where(w)}"
              f" --accelerator-type={s.accelerator_type} --runtime-version={runtime}{' --spot' if job.spot else ''}")
    start = f"cd {CHECKOUT} && {_host(job, 'start')} --run_dir={q(job.run_dir)} -- {job.train_argv()}"
    return Plan(files={}, create=(create,), ready=True, install=(ssh(job, job.install_command()),),
                start=(ssh(job, start),), stop=(ssh(job, f"cd {CHECKOUT} && {_host(job, 'stop')}"),),
                relaunches=True)


def _host(job: Job, verb: str) -> str:
    return f".venv/bin/python -m tools.pod.host {verb} --job={job.name}"


def ssh(job: Job, command: str, *, worker: str = "all") -> str:
    """The command on every host (or one), each ssh returning when its host's command does. One slice: `tpu-vm
    ssh --worker=all`, all hosts at once. Several: the queued resource's ssh reaches every node (--node=all), in
    batches of --batch-size hosts (default 64), each batch after the last has returned; each VM's TPU
    environment tells JAX its slice, so the command is the same everywhere."""
    w = job.where
    if job.num_slices == 1:
        return f"gcloud compute tpus tpu-vm ssh {w.name} {_gcloud_where(w)} --worker={worker} --command={q(command)}"
    node = "all" if worker == "all" else "0"
    return (f"gcloud compute tpus queued-resources ssh {w.name} {_gcloud_where(w)} --node={node} --worker={worker}"
            f" --command={q(command)}")


def job_state_command(job: Job) -> str:
    """tpu-vm: prints the training's state on process 0's host (worker 0 of the first slice)."""
    return ssh(job, f"cd {CHECKOUT} && {_host(job, 'state')}", worker="0")


# ---- xpk and jobset (GKE) ---------------------------------------------------------------------------


def _credentials(w: Where) -> str:
    return f"gcloud container clusters get-credentials {w.cluster} {_gcloud_where(w)}"


def _xpk(job: Job) -> Plan:
    w = job.where  # xpk's JobSet (not its Pathways one) sets no MEGASCALE_* variables: GKE's TPU webhook does
    create = (f"xpk workload create --workload={w.name} --cluster={w.cluster} {_gcloud_where(w)}"
              f" --tpu-type={job.slice.accelerator_type} --num-slices={job.num_slices}"
              f" --docker-image={job.image} --max-restarts={job.retries}"
              f" --restart-on-exit-codes={RESTART_ON_EXIT_CODES} --termination-grace-period-seconds={SIGTERM_GRACE_S}"
              f" --command={q(job.start_command())}")
    return Plan(files={}, create=(_credentials(w),), ready=False, install=(), start=(create,), stop=(),
                relaunches=False)


def _jobset(job: Job) -> Plan:
    manifest = f"{job.name}.yaml"
    credentials = (_credentials(job.where),) if job.where.cluster else ()  # else: kubectl's current context
    return Plan(files={manifest: jobset_manifest(job)}, create=credentials, ready=False, install=(),
                start=(f"kubectl apply -f {q(str(job.workdir / manifest))}",), stop=(), relaunches=False)


def jobset_manifest(job: Job) -> str:
    """One Job per slice, one pod per host, as xpk's manifest and JobSet's TPU example build them: host
    networking (the TPU runtime and JAX's coordinator listen on the node), the slice on one node pool, no
    MEGASCALE_* of its own (GKE injects them for a multislice JobSet, with TPU_WORKER_ID and
    TPU_WORKER_HOSTNAMES). JobSet restarts the whole set, up to --retries times, when a pod fails."""
    s, n = job.slice, job.name
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
        completionMode: Indexed  # (JobSet's default) GKE numbers the pods' TPU_WORKER_ID by their index
        backoffLimit: 0
        template:
          spec:
            hostNetwork: true
            dnsPolicy: ClusterFirstWithHostNet
            terminationGracePeriodSeconds: {SIGTERM_GRACE_S}
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
                limits: {{google.com/tpu: {s.chips_per_host}}}
"""


# ---- slurm -------------------------------------------------------------------------------------------


def _job_id_file(w: Where):
    return w.workdir / f"{w.name}.jobid"


def _slurm(job: Job) -> Plan:
    script, ids = job.workdir / f"{job.name}.sbatch", _job_id_file(job.where)
    submit = f"id=$(sbatch --parsable {q(str(script))}) && echo \"${{id%%;*}}\" > {q(str(ids))}"  # ID[;cluster]
    return Plan(files={script.name: sbatch_script(job)}, create=(), ready=False, install=(), start=(submit,),
                stop=(), relaunches=True)


def sbatch_script(job: Job) -> str:
    """Installs once into the submit directory (a filesystem every node mounts), then one task per node. JAX's
    Slurm detection finds the coordinator (the step's first node, on a port of this job's own), the process
    count and ids; its default of one GPU per task (SLURM_LOCALID) is replaced by all of the node's GPUs."""
    s = job.slice
    return f"""#!/bin/bash
#SBATCH --job-name={job.name}
#SBATCH --nodes={s.hosts}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={s.chips_per_host}
#SBATCH --output={job.name}-%j.log
cd "$SLURM_SUBMIT_DIR"
( {job.install_command()} ) || exit 1
export JAX_LOCAL_DEVICE_IDS={",".join(str(i) for i in range(s.chips_per_host))}
srun --ntasks-per-node=1 bash -c {q(job.train_command())}
"""
