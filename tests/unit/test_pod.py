"""tools.pod, the pod launcher, without a cloud: topology names against each target's table, the checks before
anything is created, the commands and files of each target against golden files (tests/support/golden/pod;
regenerate after an intended change: POD_GOLDEN=regenerate pytest tests/unit/test_pod.py -k golden), how each
target's state answers read, and the launcher's printed plan in the docs."""

import json
import os
import shlex
import time

import pytest

from support.cli import ROOT, run_main
from support.cloud import use
from tools.pod.__main__ import main as pod_main
from tools.pod.host import attempt_end, resumable
from tools.pod.shell import describe
from tools.pod.targets import DONE, FAILED, GONE, PENDING, PREEMPTED, RUNNING, UNKNOWN, job_state_of, state_of
from tools.pod.topology import parse_topology
from trainer.telemetry import goodput

GOLDEN = ROOT / "tests" / "support" / "golden" / "pod"
PINNED = ["--repo", "https://github.com/example/gpt2-nnx", "--commit", "0123456789abcdef0123456789abcdef01234567",
          "--workdir", "pod-files"]  # the golden files do not change with each commit
WHERE = ["--zone", "us-west4-a", "--project", "my-project"]


@pytest.mark.parametrize("name, target, chips, hosts, per_host, accelerator, shape", [
    ("v5e-256", "tpu-vm", 256, 64, 4, "v5litepod-256", "16x16"),
    ("v5e-8", "tpu-vm", 8, 1, 8, "v5litepod-8", "2x4"),  # one ct5lp-hightpu-8t VM
    ("v5e-8", "xpk", 8, 2, 4, "v5litepod-8", "2x4"),  # xpk's 2x4: two VMs of 4
    ("v6e-8", "jobset", 8, 2, 4, "v6e-8", "2x4"),  # the multi-host node pool xpk creates
    ("v6e-4", "xpk", 4, 1, 4, "v6e-4", "2x2"),
    ("v5e-4", "jobset", 4, 1, 4, "v5litepod-4", "2x2"),  # GKE's single-host 2x2 pool
    ("v5e-16", "tpu-vm", 16, 4, 4, "v5litepod-16", "4x4"),
    ("v4-8", "xpk", 4, 1, 4, "v4-8", "2x2x1"),  # v4 names count TensorCores, 2 per chip
    ("v4-32", "jobset", 16, 4, 4, "v4-32", "2x2x4"),
    ("v5p-128", "tpu-vm", 64, 16, 4, "v5p-128", "4x4x4"),
    ("v6e-64", "xpk", 64, 16, 4, "v6e-64", "8x8"),
])
def test_a_topology_name_gives_chips_and_hosts_as_the_target_builds_it(name, target, chips, hosts, per_host,
                                                                       accelerator, shape):
    s = parse_topology(name, target)
    assert (s.chips, s.hosts, s.chips_per_host, s.accelerator_type, s.shape) == (chips, hosts, per_host,
                                                                                 accelerator, shape)


def test_a_gpu_topology_is_whole_nodes():
    s = parse_topology("gpu-32", "slurm", gpus_per_node=8)
    assert (s.hosts, s.chips_per_host) == (4, 8)


@pytest.mark.parametrize("flags, message", [
    (["--topology", "v7-8", "--run_dir", "gs://b/r"], "--topology v7-8: unknown"),
    (["--topology", "v4-6", "--run_dir", "gs://b/r"], "counts TensorCores (2 per chip)"),
    (["--topology", "v5e-512", "--run_dir", "gs://b/r"], "a power of two from 1 to 256"),
    (["--target", "xpk", "--cluster", "c", "--topology", "v5e-4", "--run_dir", "gs://b/r"],
     "xpk's system_characteristics.py have no such v5e slice (--target xpk); its smallest are v5e-8, v5e-16"),
    (["--target", "jobset", "--topology", "v6e-2", "--run_dir", "gs://b/r"], "GKE's TPU node pools have no such v6e"),
    (["--target", "jobset", "--topology", "v5p-8", "--num_slices", "2", "--run_dir", "gs://b/r"],
     "GKE joins slices of several hosts only"),
    (["--target", "xpk", "--cluster", "c", "--topology", "v6e-4", "--num_slices", "2", "--run_dir", "gs://b/r"],
     "GKE joins slices of several hosts only"),
    (["--target", "ec2", "--topology", "v4-32", "--run_dir", "gs://b/r"], "--target ec2: unknown"),
    (["--topology", "v4-32", "--run_dir", "runs/x"], "--run_dir runs/x is on this machine, but the 4 hosts"),
    (["--topology", "v4-32", "--run_dir", "runs/x", "--shared_fs"], "give the absolute path"),
    (["--topology", "v4-32", "--run_dir", "gs://b/r", "--num_slices", "3"],
     "--num_slices 3 does not divide train.batch_size 8"),
    (["--topology", "gpu-16", "--run_dir", "gs://b/r"], "slurm runs gpu-N topologies"),
    (["--target", "slurm", "--topology", "gpu-12", "--run_dir", "/s/r", "--shared_fs"],
     "12 GPUs is not a whole number of 8-GPU nodes"),
    (["--topology", "v4-32", "--run_dir", "gs://b/r", "--retries", "-1"], "--retries -1"),
    (["--topology", "v4-32", "--run_dir", "gs://b/r", "--", "--train.stepz=3"], "--train.stepz"),
    (["--topology", "v4-32", "--run_dir", "gs://b/r", "--", "--run_dir=gs://b/other"],
     "give --run_dir to the launcher"),
    (["--topology", "v4-32", "--run_dir", "gs://b/r", "--name", "My_Pod"], "--name My_Pod: use lower-case"),
    (["--topology", "v4-32", "--run_dir", "gs://b/r", "--num_slices", "2", "--", "--mesh.num_slices=4"],
     "give --num_slices to the launcher"),
])
def test_bad_input_is_one_line_and_creates_nothing(tmp_path, monkeypatch, clouds, flags, message):
    cloud = use(clouds(), monkeypatch)
    code, _, err = run_main(pod_main, "launch", *WHERE, *PINNED[:4], "--workdir", str(tmp_path / "w"), *flags)
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert message in err
    assert cloud.calls() == [] and not (tmp_path / "w").exists()


def test_a_tpu_vm_launch_needs_a_zone_and_a_project():
    code, _, err = run_main(pod_main, "launch", "--topology", "v4-32", "--run_dir", "gs://b/r", *PINNED)
    assert code == 2 and err.strip() == "error: --target tpu-vm needs --zone and --project"


CASES = {
    "tpu-vm": ["--topology", "v5e-256", *WHERE],
    "tpu-vm-multislice": ["--topology", "v5e-256", "--num_slices", "2", "--spot", *WHERE],
    "xpk": ["--target", "xpk", "--topology", "v5p-128", "--cluster", "my-cluster", "--retries", "5", *WHERE],
    "xpk-multislice": ["--target", "xpk", "--topology", "v5e-256", "--num_slices", "4", "--cluster", "c", *WHERE],
    "jobset": ["--target", "jobset", "--topology", "v4-32", "--retries", "3"],
    "jobset-multislice": ["--target", "jobset", "--topology", "v6e-64", "--num_slices", "2"],
    "jobset-cluster": ["--target", "jobset", "--topology", "v4-32", "--cluster", "my-cluster", *WHERE],
    "slurm": ["--target", "slurm", "--topology", "gpu-32", "--run_dir", "/shared/runs/gpt2", "--shared_fs"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_dry_run_prints_the_golden_commands(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = [] if "--run_dir" in CASES[case] else ["--run_dir", "gs://my-bucket/runs/gpt2_xl"]
    code, out, err = run_main(pod_main, "launch", "--name", "gpt2-pod", *CASES[case], *run_dir, *PINNED,
                              "--dry_run", "--", "--config", "gpt2_xl_pod", "--data.dataset=/data/fineweb")
    assert code == 0, err
    assert not (tmp_path / "pod-files").exists()  # a dry run writes nothing
    golden = GOLDEN / f"{case}.txt"
    if os.environ.get("POD_GOLDEN") == "regenerate":
        golden.write_text(out)
    assert out == golden.read_text(), f"{case}: differs from {golden} (POD_GOLDEN=regenerate to accept)"


def golden(case: str) -> str:
    return (GOLDEN / f"{case}.txt").read_text()


def test_a_tpu_vm_training_starts_detached_on_every_host_of_every_slice():
    """The training's ssh returns at once on every host (its batches no longer wait on each other's training):
    tools.pod.host starts it in its own session; the keep-alive asks process 0's host, not the ssh."""
    for case, ssh in (("tpu-vm", "tpu-vm ssh gpt2-pod"), ("tpu-vm-multislice", "queued-resources ssh gpt2-pod")):
        start = next(line for line in golden(case).splitlines() if "train.py" in line and line.startswith("$"))
        assert f"gcloud compute tpus {ssh} " in start and "--worker=all" in start
        assert "-m tools.pod.host start --job=gpt2-pod --run_dir=gs://my-bucket/runs/gpt2_xl -- .venv/bin/python" \
               " train.py" in start
        assert ("--node=all" in start) == (case == "tpu-vm-multislice")
        assert "-m tools.pod.host state --job=gpt2-pod" in golden(case) and "--worker=0" in golden(case)


def test_gke_follows_jobset_and_xpk_with_one_restart_owner():
    """JobSet's TPU example and xpk's manifest: host networking, its DNS policy, a SIGTERM grace that covers a
    save, no MEGASCALE_* of our own (GKE sets them); JobSet restarts (maxRestarts), the launcher does not. xpk
    runs the same container command as the JobSet, restarting on the trainer's exit codes too."""
    manifest = golden("jobset-multislice")
    for line in ("hostNetwork: true", "dnsPolicy: ClusterFirstWithHostNet", "terminationGracePeriodSeconds: 120",
                 "maxRestarts: 0", "replicas: 2", "parallelism: 16", "limits: {google.com/tpu: 4}"):
        assert line in manifest, line
    assert "MEGASCALE" not in manifest and "restarted by JobSet" in manifest
    xpk = golden("xpk")
    assert "--max-restarts=5 --restart-on-exit-codes=1-2 --termination-grace-period-seconds=120" in xpk
    assert "restarted by JobSet up to 5 times" in xpk and "relaunched by this launcher" not in xpk
    container = json.loads(golden("jobset").split('command: ["bash", "-c", ', 1)[1].split("]\n", 1)[0])
    assert shlex.split(xpk.split("--command=", 1)[1].split("\n")[0]) == [container]  # as bash unquotes it


def test_slurm_lets_jax_find_the_job_on_every_gpu_and_follows_it_by_id():
    """JAX's Slurm detection on every GPU; the node asked for as every site grants it (--gres, not the --gpu*
    options that need select/cons_tres; the whole node, its memory, every CPU for the task); the job followed
    by its id, and by its own end record where sacct is disabled."""
    script = golden("slurm")
    assert "export JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7\n" in script  # not JAX's one GPU per task
    assert "JAX_COORDINATOR_ADDRESS" not in script and "tools.pod.host start" not in script  # JAX's detection
    for line in ("#SBATCH --gres=gpu:8\n", "#SBATCH --exclusive\n", "#SBATCH --mem=0\n",
                 "end=pod-files/gpt2-pod.end.\"$SLURM_JOB_ID\"\ntrap 'echo \"exit $?\" > \"$end\"' EXIT\n",
                 'srun --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" bash -c \'cd gpt2-nnx && exec'
                 ' .venv/bin/python -m tools.pod.host train --run_dir=/shared/runs/gpt2 -- .venv/bin/python train.py'):
        assert line in script, line
    assert "--gpus" not in script and "sacct" not in script
    ids = "pod-files/gpt2-pod.jobid"
    assert f"id=$(sbatch --parsable pod-files/gpt2-pod.sbatch) && echo \"${{id%%;*}}\" > {ids}" in script
    assert f"id=$(cat {ids}) && {{ squeue -h --jobs=\"$id\" --states=all -o %T 2>&1; cat pod-files/gpt2-pod.end." \
           f"\"$id\" 2>/dev/null; }}" in script and f"scancel $(cat {ids})" in script
    assert "squeue -h -n" not in script and "--name=" not in script  # a job's name is not its own


def test_every_host_installs_on_uv_python_and_each_target_says_what_a_failed_host_does():
    """The image's python3 (3.10 on the TPU VM images, perhaps without venv) is never the hosts' Python: uv's own
    3.11, uv from pip's user site or its pinned installer. The dry run says so, and what a failed host leads to."""
    for case in CASES:
        text = golden(case)
        assert "python3 -m venv" not in text and " venv -q --allow-existing --python 3.11 .venv" in text, case
        assert "python3 -m pip install -q --user uv==0.12.5 || curl -LsSf https://astral.sh/uv/0.12.5/install.sh" \
               in text and "uv's own Python 3.11 (not the image's python3)" in text, case
        assert "# a failed host: " in text and "# before anything is created, each a one-line refusal:" in text
        assert ("exec .venv/bin/python -m tools.pod.host train" in text) == (not case.startswith("tpu-vm")), case
    assert "run again on every host, 3 times in all (10 s, 20 s apart), then the launch ends in one line that" \
           " prints the delete command" in golden("tpu-vm")
    assert "JobSet restarts every pod, up to 5 times (failurePolicy.maxRestarts), a saved preemption's exit 42" \
           in golden("xpk")


def test_xpk_finds_its_cluster_itself_and_jobset_asks_its_location():
    """xpk's clusters are regional and xpk finds their location and credentials itself (commands/common.py): no
    get-credentials before `xpk workload create`; jobset's credentials at the cluster's location, which the launch
    looks up as xpk does before anything is created (the dry run shows the region)."""
    assert "get-credentials" not in golden("xpk") and "--skip-validation --command=" in golden("xpk")
    assert "$ gcloud container clusters get-credentials my-cluster --location=us-west4 --project=my-project" in \
        golden("jobset-cluster")
    assert "gcloud container clusters list --project=my-project --filter=name=my-cluster --format='value(location)'" \
        in golden("xpk")


@pytest.mark.parametrize("target, rc, out, err, state", [
    ("tpu-vm", 0, "ACTIVE\n", "", RUNNING),
    ("tpu-vm", 0, "WAITING_FOR_RESOURCES\n", "", PENDING),
    ("tpu-vm", 0, "SUSPENDED\n", "", GONE),  # preempted
    ("tpu-vm", 1, "", "ERROR: (gcloud.compute.tpus.queued-resources.describe) NOT_FOUND: Resource 'x' was not found",
     GONE),  # deleted
    ("tpu-vm", 1, "", "ERROR: (gcloud.compute.tpus.queued-resources.describe) There was a problem refreshing your"
                      " current auth tokens", UNKNOWN),
    ("tpu-vm", 0, "", "", UNKNOWN),
    ("jobset", 0, "", "", RUNNING), ("jobset", 0, "Completed", "", DONE), ("jobset", 0, "Failed", "", FAILED),
    ("jobset", 1, "", 'Error from server (NotFound): jobsets.jobset.x-k8s.io "pod" not found', GONE),
    ("xpk", 1, "", "Unable to connect to the server: dial tcp 10.0.0.1:443: i/o timeout", UNKNOWN),
    ("slurm", 0, "PENDING\n", "", PENDING), ("slurm", 0, "COMPLETED\n", "", DONE),
    ("slurm", 0, "CANCELLED\n", "", FAILED), ("slurm", 0, "NODE_FAIL\n", "", FAILED),
    ("slurm", 0, "slurm_load_jobs error: Socket timed out on send/recv operation\n", "", UNKNOWN),
    # the batch script's own end record decides; a job slurmctld forgot without one is gone
    ("slurm", 0, "slurm_load_jobs error: Invalid job id specified\nexit 0\n", "", DONE),
    ("slurm", 0, "FAILED\nexit 42\n", "", PREEMPTED), ("slurm", 0, "exit 2\n", "", FAILED),
    ("slurm", 0, "slurm_load_jobs error: Invalid job id specified\n", "", GONE),
    ("slurm", 1, "", "cat: pod-files/pod.jobid: No such file or directory", UNKNOWN),
])
def test_each_target_state_reads_as_the_real_tool_answers(target, rc, out, err, state):
    """An explicit answer that the slice or job is gone is acted on; a failed state command (an API or network
    error) says nothing about the job."""
    assert state_of(target, rc, out, err) == state


def test_a_tpu_vm_host_record_of_a_saved_preemption_reads_as_one():
    assert [job_state_of(0, f"{w}\n") for w in ("running", "0", "42", "1", "lost", "none")] == \
        [RUNNING, DONE, PREEMPTED, FAILED, FAILED, FAILED]
    assert job_state_of(255, "") == UNKNOWN


def test_a_saved_preemption_is_42_on_the_host_that_wrote_it(tmp_path):
    """`resumable`: exit 0 with this attempt's "preempted" end is 42; a record older than the attempt (another
    host's process ending first) or a finished one keeps 0; a signal N is 128 + N."""
    since = time.time()
    events = tmp_path / "events.jsonl"
    events.write_text(json.dumps({"event": "attempt_end", "time": since - 5, "how": "preempted"}) + "\n")
    assert resumable(0, str(tmp_path), since) == 0 and attempt_end(str(tmp_path), 0) == "preempted"
    with open(events, "a") as f:
        f.write(json.dumps({"event": "attempt_end", "time": since + 1, "how": "preempted"}) + "\n{torn")
    assert resumable(0, str(tmp_path), since) == 42 and resumable(3, str(tmp_path), since) == 3
    assert resumable(-15, str(tmp_path), since) == 143 and resumable(0, str(tmp_path / "none"), since) == 0


def test_a_failed_ssh_step_names_the_workers_gcloud_names():
    tail = ["SSH: Attempting to connect to worker 0...", "[0/1] error: Failed to fetch", "[0/1]   Caused by: 503",
            "##### Command execution on worker 1 failed with exit status 2. Continuing.",
            "##### Command execution on worker 3 failed with exit status 2. Continuing."]
    assert describe(2, tail) == "workers 1, 3 exited 2: [0/1]   Caused by: 503"
    assert describe(255, []) == "exit status 255"


def test_the_docs_show_what_the_launcher_prints(monkeypatch):
    """docs/pods.md's manual commands are the dry run of its first launch command (the commit aside)."""
    import re

    page = (ROOT / "docs" / "pods.md").read_text()
    command = next(line for line in page.splitlines() if line.startswith("python -m tools.pod launch"))
    shown = page.split("```text\n", 1)[1].split("```", 1)[0]
    code, out, err = run_main(pod_main, *command.split()[3:])
    assert code == 0, err
    out = re.sub(r"\b[0-9a-f]{12}\b", "<commit>", re.sub(r"[0-9a-f]{40}", "<commit>", out))
    assert out == shown


def test_the_goodput_report_counts_a_relaunch_gap_from_the_last_record_of_the_dead_attempt():
    """The launcher's `relaunch` record sits between the attempts; the restart gap still runs from the dead
    attempt's last record to the next attempt's start (the relaunch's own time does not end it)."""
    records = [
        {"event": "attempt_start", "attempt": 1, "time": 0.0},
        {"event": "train_call", "attempt": 1, "first": 0, "steps": 2, "seconds": 2.0, "skipped": 0, "start": 1.0,
         "end": 3.0},
        {"event": "relaunch", "time": 10.0, "number": 1, "reason": "the slice is gone"},
        {"event": "attempt_start", "attempt": 2, "time": 30.0},
        {"event": "attempt_end", "attempt": 2, "time": 31.0, "how": "finished"},
    ]
    report = goodput.report(records)
    assert report.seconds["restart_gap"] == 27.0 and report.relaunches == 1 and report.wall == 31.0
    assert "1 relaunch(es) by tools.pod" in report.text().splitlines()[0]
