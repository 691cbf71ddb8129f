"""The commands and files each target needs, as the launcher runs them and `--dry_run` prints them, and how each
target's own answers read as a job's state.

tpu-vm: a queued resource (one slice, or `--node-count` slices), the install over `ssh --worker=all`, then the
training started detached on every host (tools/pod/host.py) so that it outlives the ssh session; the keep-alive
reads the queued resource's state and, while it is ACTIVE, process 0's host's record of the training. xpk: `xpk
workload create` (xpk finds the cluster's location and its credentials itself). jobset: a JobSet manifest for
`kubectl apply -f`. slurm: an sbatch script, one task per node, that records its own end (no `sacct` needed).

Who relaunches (one owner per target): the launcher for tpu-vm and slurm (`--retries`); for xpk and jobset JobSet
itself (its failurePolicy.maxRestarts is `--retries`), the launcher only follows it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex

from tools.pod.host import PREEMPTED as PREEMPTED_EXIT
from tools.pod.job import CHECKOUT, RUNTIME_VERSIONS, Job, Where

TARGETS = ("tpu-vm", "xpk", "jobset", "slurm")
RUNNING, PENDING, DONE, FAILED, GONE, UNKNOWN = "running", "pending", "done", "failed", "gone", "unknown"
PREEMPTED = "preempted"  # the training saved a checkpoint after a SIGTERM and ended: to be started again
# A pod's SIGTERM grace (JobSet's terminationGracePeriodSeconds, xpk's flag): the trainer saves a checkpoint
# when SIGTERM comes (trainer/run/preemption.py): one train call plus a save. Kubernetes' default is 30 s.
SIGTERM_GRACE_S = 120
RESTART_ON_EXIT_CODES = "1-2"  # xpk restarts on 42 and 127-255 only; the trainer's errors exit 1 or 2 (and a
# process that a peer's failure ends exits 2), so without these a failure would end the JobSet, not restart it.
# A saved preemption ends with 42 (tools/pod/host.py PREEMPTED), which xpk restarts on by default.


@dataclasses.dataclass(frozen=True)
class Plan:
    files: dict[str, str]  # name under the job's workdir -> text (a manifest, a batch script)
    create: tuple[str, ...]  # run in order before the job starts; each must succeed
    ready: bool  # tpu-vm: wait until the queued resource is ACTIVE before the install
    install: tuple[str, ...]  # tpu-vm: the install on every host
    start: tuple[str, ...]  # starts the training and returns (tpu-vm: detached on every host; else a submission)
    stop: tuple[str, ...]  # tpu-vm: ends what is left of an attempt on every host, before a restart there
    relaunches: bool  # the launcher relaunches (tpu-vm, slurm); else JobSet restarts the job itself
    on_failure: str  # --dry_run: what a failed host leads to


def q(text: str) -> str:
    return shlex.quote(text)


def plan(job: Job) -> Plan:
    return {"tpu-vm": _tpu_vm, "xpk": _xpk, "jobset": _jobset, "slurm": _slurm}[job.where.target](job)


def state_command(w: Where) -> str:
    """Prints the state of the job's resource (see `state_of`)."""
    if w.target == "tpu-vm":
        return (f"gcloud compute tpus queued-resources describe {w.name} {_gcloud_where(w)}"
                " --format='value(state.state)'")
    if w.target == "slurm":  # squeue while slurmctld remembers the job (--states=all: its end state too, for
        # MinJobAge), then the end the batch script recorded itself: sacct may be disabled
        ids, ends = q(str(_job_id_file(w))), q(str(_job_end_file(w, "")))
        return (f"id=$(cat {ids}) && {{ squeue -h --jobs=\"$id\" --states=all -o %T 2>&1;"
                f" cat {ends}\"$id\" 2>/dev/null; }}")
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
        return _slurm_state(out)
    if rc != 0:  # kubectl: "Error from server (NotFound)" for a JobSet that does not exist
        return GONE if "(NotFound)" in err else UNKNOWN
    return {"": RUNNING, "COMPLETED": DONE}.get(word, FAILED)  # JobSet's terminalState: Completed or Failed


def _slurm_state(out: str) -> str:
    """The batch script's own record of its end (`exit N`) decides; else squeue's state word; else squeue's
    answer that slurmctld no longer knows the job (ended without a record: a node lost, a SIGKILL) is GONE, and
    anything else (slurmctld unreachable) UNKNOWN."""
    lines = out.strip().splitlines()
    end = next((line.split()[1] for line in lines if line.startswith("exit ")), None)
    if end is not None:
        return {"0": DONE, str(PREEMPTED_EXIT): PREEMPTED}.get(end, FAILED)
    words = [line.strip().upper() for line in lines if re.fullmatch(r"[A-Z_]+", line.strip())]
    if words:
        return {"RUNNING": RUNNING, "COMPLETING": RUNNING, "PENDING": PENDING, "CONFIGURING": PENDING,
                "REQUEUED": PENDING, "RESIZING": RUNNING, "SUSPENDED": PENDING, "STAGE_OUT": RUNNING,
                "COMPLETED": DONE}.get(words[0], FAILED)
    return GONE if "Invalid job id specified" in out else UNKNOWN


def job_state_of(rc: int, out: str) -> str:
    """tpu-vm: the training's state from `python -m tools.pod.host state` on process 0's host."""
    word = out.strip().split()[-1] if rc == 0 and out.strip() else ""
    return {"": UNKNOWN, "running": RUNNING, "0": DONE, str(PREEMPTED_EXIT): PREEMPTED}.get(word, FAILED)


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
    waits = " s, ".join(f"{job.backoff_seconds * 2 ** i:g}" for i in range(job.tries - 1))
    on_failure = (f"a host whose install or start fails (gcloud names its worker) fails the step: it is run again on"
                  f" every host, {job.tries} times in all ({waits} s apart), then the launch ends in one line"
                  f" {'and deletes the slice' if job.delete_on_failure else 'that prints the delete command'}; a"
                  f" host whose training fails: relaunched on the same hosts (below)")
    return Plan(files={}, create=(create,), ready=True, install=(ssh(job, job.install_command()),),
                start=(ssh(job, start),), stop=(ssh(job, f"cd {CHECKOUT} && {_host(job, 'stop')}"),),
                relaunches=True, on_failure=on_failure)


def _host(job: Job, verb: str) -> str:
    return f".venv/bin/python -m tools.pod.host {verb} --job={job.name}"


def ssh(job: Job, command: str, *, worker: str = "all") -> str:
    """The command on every host (or one), each ssh returning when its host's command does. One slice: `tpu-vm
    ssh --worker=all`, all hosts at once. Several: the queued resource's ssh reaches every node (--node=all), in
    batches of --batch-size hosts (default 64), each batch after the last has returned; each VM's TPU
    environment tells JAX its slice, so the command is the same everywhere. A worker whose command fails is
    named on gcloud's stderr and makes gcloud's status non-zero (after the whole batch; no later batch runs)."""
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


def credentials_command(job: Job) -> str:
    """jobset --cluster: kubectl's credentials for the cluster at its own location (a region for the clusters
    xpk creates; `--zone` there would answer 404), found before anything is created (tools/pod/preflight.py)."""
    w = job.where
    return (f"gcloud container clusters get-credentials {w.cluster} --location={job.cluster_location}"
            f" --project={w.project}")


def _gke_on_failure(job: Job) -> str:
    return (f"a pod that fails (its install included) fails its Job: JobSet restarts every pod, up to"
            f" {job.retries} times (failurePolicy.maxRestarts), a saved preemption's exit {PREEMPTED_EXIT} too; then"
            " the launcher reports the Failed JobSet in one line with the delete command")


def _xpk(job: Job) -> Plan:
    """xpk finds the cluster's location (`gcloud container clusters list`) and gets its credentials itself, and
    leaves kubectl's context on the cluster (commands/common.py, core/cluster.py); --skip-validation: the
    launcher checked gcloud and kubectl (tools/pod/preflight.py), and xpk's own check runs `docker version`,
    which a launch from --docker-image does not need."""
    w = job.where  # xpk's JobSet (not its Pathways one) sets no MEGASCALE_* variables: GKE's TPU webhook does
    create = (f"xpk workload create --workload={w.name} --cluster={w.cluster} {_gcloud_where(w)}"
              f" --tpu-type={job.slice.accelerator_type} --num-slices={job.num_slices}"
              f" --docker-image={job.image} --max-restarts={job.retries}"
              f" --restart-on-exit-codes={RESTART_ON_EXIT_CODES} --termination-grace-period-seconds={SIGTERM_GRACE_S}"
              f" --skip-validation --command={q(job.start_command())}")
    return Plan(files={}, create=(), ready=False, install=(), start=(create,), stop=(), relaunches=False,
                on_failure=_gke_on_failure(job))


def _jobset(job: Job) -> Plan:
    manifest = f"{job.name}.yaml"
    credentials = (credentials_command(job),) if job.where.cluster else ()  # else: kubectl's current context
    return Plan(files={manifest: jobset_manifest(job)}, create=credentials, ready=False, install=(),
                start=(f"kubectl apply -f {q(str(job.workdir / manifest))}",), stop=(), relaunches=False,
                on_failure=_gke_on_failure(job))


def jobset_manifest(job: Job) -> str:
    """One Job per slice, one pod per host, as xpk's manifest and JobSet's TPU example build them: host
    networking (the TPU runtime and JAX's coordinator listen on the node), the slice on one node pool, no
    MEGASCALE_* of its own (GKE injects them for a multislice JobSet, with TPU_WORKER_ID and
    TPU_WORKER_HOSTNAMES). JobSet restarts the whole set, up to --retries times, when a pod fails (no
    failurePolicy rules: every Job failure is RestartJobSet); a saved preemption's pod fails with 42 (every pod
    exiting 0 would make the JobSet Completed, never restarted)."""
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


def _job_end_file(w: Where, job_id: str):
    """Where the batch script records its end: in the launcher's workdir, which the first node must see (as it
    sees the submit directory; a home directory is shared on most clusters)."""
    return w.workdir / f"{w.name}.end.{job_id}"


def _slurm(job: Job) -> Plan:
    script, ids = job.workdir / f"{job.name}.sbatch", _job_id_file(job.where)
    submit = f"id=$(sbatch --parsable {q(str(script))}) && echo \"${{id%%;*}}\" > {q(str(ids))}"  # ID[;cluster]
    on_failure = (f"a node whose task fails ends the step (srun) and the job: the launcher submits it again, up to"
                  f" {job.retries} times; a failed install ends the job at once")
    return Plan(files={script.name: sbatch_script(job)}, create=(), ready=False, install=(), start=(submit,),
                stop=(), relaunches=True, on_failure=on_failure)


def sbatch_script(job: Job) -> str:
    """Installs once into the submit directory (a filesystem every node mounts), then one task per node. The
    resources the portable way (sbatch.1, doc/html/gres.shtml): `--gres=gpu:N` (every --gpu* option needs
    select/cons_tres, rejected elsewhere), the whole node (`--exclusive`: all its CPUs and GPUs; `--mem=0`: all
    its memory; sites default to 1 CPU per task and a small DefMemPerCPU), and the task given every CPU the node
    has (srun.1: "The default is one CPU per process"). JAX's Slurm detection finds the
    coordinator (the step's first node, on a port of this job's own), the process count and ids; its default of
    one GPU per task (SLURM_LOCALID) is replaced by all of the node's GPUs. The script records its exit status
    itself (the EXIT trap), for the keep-alive where sacct is disabled and squeue has forgotten the job."""
    s, end = job.slice, q(str(_job_end_file(job.where, "")))
    return f"""#!/bin/bash
#SBATCH --job-name={job.name}
#SBATCH --nodes={s.hosts}
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:{s.chips_per_host}
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --output={job.name}-%j.log
cd "$SLURM_SUBMIT_DIR"
end={end}"$SLURM_JOB_ID"
trap 'echo "exit $?" > "$end"' EXIT
( {job.install_command()} ) || exit 1
export JAX_LOCAL_DEVICE_IDS={",".join(str(i) for i in range(s.chips_per_host))}
srun --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" bash -c {q(job.train_command())}
"""
