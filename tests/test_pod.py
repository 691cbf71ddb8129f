"""tools.pod, the pod launcher: topology names, its checks before anything is created, the commands and files
of each target against golden files, the host's place in the JAX job, and end to end against a simulated pod
(tests/fake_cloud.py: fake gcloud and friends, TPU VMs as local processes): a 2-host launch trains to the end,
and a preempted slice is recreated and the run resumes to an uninterrupted run's losses.

The simulated hosts `git clone` this checkout and run its committed HEAD. Times on a loaded 2-core machine: the
fast tests ~10-25 s together; slow ones: the reference run ~1.5-3 min (once per module), the 2-host launch with its
AOT compile ~2.5 min, each relaunch case ~3 min, xpk / JobSet / Slurm ~1.5-2.5 min each, the refusal ~11 s.

Regenerate the golden files after an intended change: POD_GOLDEN=regenerate pytest tests/test_pod.py -k golden
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from fake_cloud import FakeCloud

import train as train_app
from conftest import ROOT, SMALL, read_jsonl, run_main
from tools.pod.__main__ import main as pod_main
from tools.pod.host import job_env
from tools.pod.topology import parse_topology
from trainer.telemetry import goodput

GOLDEN = ROOT / "tests" / "golden" / "pod"
PINNED = ["--repo", "https://github.com/example/gpt2-nnx", "--commit", "0123456789abcdef0123456789abcdef01234567",
          "--workdir", "pod-files"]  # the golden files do not change with each commit
WHERE = ["--zone", "us-west4-a", "--project", "my-project"]


@pytest.mark.parametrize("name, chips, hosts, per_host, accelerator, shape", [
    ("v5e-256", 256, 64, 4, "v5litepod-256", "16x16"),
    ("v5e-8", 8, 1, 8, "v5litepod-8", "2x4"),  # one ct5lp-hightpu-8t VM
    ("v5e-16", 16, 4, 4, "v5litepod-16", "4x4"),
    ("v4-8", 4, 1, 4, "v4-8", "2x2x1"),  # v4 names count TensorCores, 2 per chip
    ("v4-32", 16, 4, 4, "v4-32", "2x2x4"),
    ("v5p-128", 64, 16, 4, "v5p-128", "4x4x4"),
    ("v6e-64", 64, 16, 4, "v6e-64", "8x8"),
])
def test_a_topology_name_gives_chips_and_hosts(name, chips, hosts, per_host, accelerator, shape):
    s = parse_topology(name)
    assert (s.chips, s.hosts, s.chips_per_host, s.accelerator_type, s.shape) == (chips, hosts, per_host,
                                                                                 accelerator, shape)


def test_a_gpu_topology_is_whole_nodes():
    s = parse_topology("gpu-32", gpus_per_node=8)
    assert (s.hosts, s.chips_per_host) == (4, 8)


# ---- bad input: one line, non-zero, nothing created -------------------------------------------------


@pytest.mark.parametrize("flags, message", [
    (["--topology", "v7-8", "--run_dir", "gs://b/r"], "--topology v7-8: unknown"),
    (["--topology", "v4-6", "--run_dir", "gs://b/r"], "counts TensorCores (2 per chip)"),
    (["--target", "ec2", "--topology", "v4-32", "--run_dir", "gs://b/r"], "--target ec2: unknown"),
    (["--topology", "v4-32", "--run_dir", "runs/x"], "--run_dir runs/x is on this machine, but the 4 hosts"),
    (["--topology", "v4-32", "--run_dir", "runs/x", "--shared_fs"], "give the absolute path"),
    (["--topology", "v4-32", "--run_dir", "gs://b/r", "--num_slices", "3"],
     "--num_slices 3 does not divide train.batch_size 8"),
    (["--topology", "gpu-16", "--run_dir", "gs://b/r"], "slurm runs gpu-N topologies"),
    (["--topology", "v4-32", "--run_dir", "gs://b/r", "--", "--train.stepz=3"], "--train.stepz"),
    (["--topology", "v4-32", "--run_dir", "gs://b/r", "--", "--run_dir=gs://b/other"],
     "give --run_dir to the launcher"),
    (["--topology", "v4-32", "--run_dir", "gs://b/r", "--name", "My_Pod"], "--name My_Pod: use lower-case"),
    (["--topology", "v4-32", "--run_dir", "gs://b/r", "--num_slices", "2", "--", "--mesh.num_slices=4"],
     "give --num_slices to the launcher"),
])
def test_bad_input_is_one_line_and_creates_nothing(tmp_path, monkeypatch, flags, message):
    cloud = FakeCloud(tmp_path / "cloud")
    monkeypatch.setenv("PATH", cloud.env()["PATH"])
    monkeypatch.setenv("FAKE_CLOUD_DIR", str(cloud.root))
    code, _, err = run_main(pod_main, "launch", *WHERE, *PINNED[:4], "--workdir", str(tmp_path / "w"), *flags)
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert message in err
    assert cloud.calls() == [] and not (tmp_path / "w").exists()


def test_a_tpu_vm_launch_needs_a_zone_and_a_project():
    code, _, err = run_main(pod_main, "launch", "--topology", "v4-32", "--run_dir", "gs://b/r", *PINNED)
    assert code == 2 and err.strip() == "error: --target tpu-vm needs --zone and --project"


# ---- the commands and files of every target, against golden files -----------------------------------

CASES = {
    "tpu-vm": ["--topology", "v5e-256", *WHERE],
    "tpu-vm-multislice": ["--topology", "v5e-256", "--num_slices", "2", "--spot", *WHERE],
    "xpk": ["--target", "xpk", "--topology", "v5p-128", "--cluster", "my-cluster", "--retries", "5", *WHERE],
    "xpk-multislice": ["--target", "xpk", "--topology", "v5e-256", "--num_slices", "4", "--cluster", "c", *WHERE],
    "jobset": ["--target", "jobset", "--topology", "v4-32", "--retries", "3"],
    "jobset-multislice": ["--target", "jobset", "--topology", "v6e-64", "--num_slices", "2"],
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


def test_every_target_trains_on_every_host():
    """The golden commands: the training command reaches every host (ssh --worker=all, one pod per host,
    srun one task per node), never the head host alone."""
    texts = {case: (GOLDEN / f"{case}.txt").read_text() for case in CASES}
    assert all(line.count("--worker=all") == 1 for line in texts["tpu-vm"].splitlines() if "ssh" in line)
    assert "parallelism: 16" in texts["jobset-multislice"] and "replicas: 2" in texts["jobset-multislice"]
    assert "srun --ntasks-per-node=1" in texts["slurm"] and "--nodes=4" in texts["slurm"]
    assert "--num-slices=4" in texts["xpk-multislice"] and "--mesh.num_slices=4" in texts["xpk-multislice"]
    assert "--aot v6e:8x8*2" in texts["jobset-multislice"]  # the launcher compiles both slices' program


# ---- a host's place in the job -------------------------------------------------------------------------


def test_a_host_maps_its_platform_to_jax_process_ids():
    tpu = {"TPU_WORKER_ID": "1", "TPU_WORKER_HOSTNAMES": "10.0.0.2,10.0.0.3"}
    assert job_env(tpu) == {"JAX_COORDINATOR_ADDRESS": "10.0.0.2:8476", "JAX_NUM_PROCESSES": "2",
                            "JAX_PROCESS_ID": "1"}
    multislice = {**tpu, "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "1",
                  "MEGASCALE_COORDINATOR_ADDRESS": "10.0.1.9"}
    assert job_env(multislice) == {"JAX_COORDINATOR_ADDRESS": "10.0.1.9:8476", "JAX_NUM_PROCESSES": "4",
                                   "JAX_PROCESS_ID": "3"}
    assert job_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "JAX_COORDINATOR_ADDRESS": "n1:12355"}) == {
        "JAX_PROCESS_ID": "3", "JAX_NUM_PROCESSES": "4"}
    assert job_env({}) == {}  # a TPU VM's metadata server: JAX's own detection


def test_the_fake_cloud_shows_a_command_that_reached_one_host_only(tmp_path):
    """The check the end-to-end tests make (`trained_on_every_host`) fails for an ssh without --worker=all."""
    cloud = FakeCloud(tmp_path)
    env = cloud.env()
    for argv in (["queued-resources", "create", "p", "--accelerator-type=v4-16"],
                 ["tpu-vm", "ssh", "p", "--command=python3 -c 0 train.py"]):
        subprocess.run(["gcloud", "compute", "tpus", *argv], env=env, check=True, capture_output=True)
    assert not trained_on_every_host(cloud, hosts=2)
    subprocess.run(["gcloud", "compute", "tpus", "tpu-vm", "ssh", "p", "--worker=all", "--command=true train.py"],
                   env=env, check=True, capture_output=True)
    assert trained_on_every_host(cloud, hosts=2)


def trained_on_every_host(cloud: FakeCloud, hosts: int) -> bool:
    """Whether, on every slice the cloud created, each of its hosts ran train.py."""
    runs = [r for r in cloud.worker_runs() if "train.py" in r["command"]]
    slices = {r["slice"] for r in runs}
    return bool(slices) and all({r["worker"] for r in runs if r["slice"] == s} == set(range(hosts)) for s in slices)


# ---- end to end on a simulated pod -------------------------------------------------------------------

RUN = [*SMALL, "--train.steps=64", "--train.eval_every=0", "--checkpoint.every=8", "--mesh.fsdp=2"]
SHORT = [*RUN, "--train.steps=8"]  # its first 8 steps: one learning-rate schedule for any length (SMALL)


def launch_on_fake_pod(cloud, run_dir, shakespeare, *flags, run=RUN):
    """tools.pod launch on a 2-host v4-16 (4 chips each) of the fake cloud; hosts clone this checkout."""
    topology = [] if "--topology" in flags else ["--topology", "v4-16"]
    cmd = [sys.executable, "-m", "tools.pod", "launch", *topology, "--name", "pod", *WHERE, "--cluster", "c",
           "--run_dir", str(run_dir), "--shared_fs", "--repo", str(ROOT), "--workdir", str(cloud.root / "w"),
           "--poll_seconds", "0.5", *flags, "--", f"--data.cache_dir={shakespeare}", *run]
    env = {**cloud.env(), "PYTHONPATH": str(ROOT), "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}  # the AOT check beside
    # another user of libtpu on this machine (as tests/test_aot.py)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def losses(run_dir):
    return [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, shakespeare):
    """The same run uninterrupted, one process of 8 devices."""
    run_dir = tmp_path_factory.mktemp("reference")
    code, _, err = run_main(train_app.main, "--run_dir", str(run_dir), f"--data.cache_dir={shakespeare}", *RUN)
    assert code == 0, err[-3000:]
    return run_dir


@pytest.mark.slow
def test_a_two_host_launch_compiles_first_and_trains_to_the_end(tmp_path, shakespeare, reference):
    cloud = FakeCloud(tmp_path / "cloud")
    proc = launch_on_fake_pod(cloud, tmp_path / "run", shakespeare, run=SHORT)
    out = proc.communicate(timeout=900)[0]
    assert proc.returncode == 0, out[-4000:]
    assert "v4-16: 8 chips, 2 hosts of 4" in out and "AOT compile for v4:2x2x2" in out and "fits in HBM" in out
    assert "pod: the run finished" in out
    assert trained_on_every_host(cloud, hosts=2)
    np.testing.assert_allclose(losses(tmp_path / "run"), losses(reference)[:8], rtol=0, atol=1e-5)
    commands = [" ".join(c[:5]) for c in cloud.calls()]
    assert commands.count("gcloud compute tpus queued-resources create") == 1
    assert (cloud.root / "pip.log").read_text().count("-e .[tpu,gcs]") == 2  # the install, on each host


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["preempted", "worker_killed"])
def test_a_lost_slice_or_worker_is_relaunched_and_the_run_resumes_exactly(tmp_path, shakespeare, reference, fault):
    """preempted: the slice is SUSPENDED and its hosts gone: deleted, created again, installed, started.
    worker_killed: worker 1's train.py dies (kill -9), the slice stays ACTIVE: worker 0 fails after the
    heartbeat timeout and the same command starts again on the same hosts."""
    cloud = FakeCloud(tmp_path / "cloud", devices_per_host=1)  # the lightest 2-process job: 1 device each
    run_dir = tmp_path / "run"
    proc = launch_on_fake_pod(cloud, run_dir, shakespeare, "--skip_aot", "--retries", "2",
                              run=[*RUN, "--distributed.heartbeat_timeout_seconds=20"])
    deadline = time.time() + 600
    while not (run_dir / "checkpoints" / "16").exists():  # a checkpoint to resume from
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-4000:]
        time.sleep(0.1)
    cloud.preempt("pod") if fault == "preempted" else cloud.kill_worker("pod", 1)
    out = proc.communicate(timeout=900)[0]
    assert proc.returncode == 0, out[-4000:]
    assert "relaunch 1 of 2" in out
    commands = [" ".join(c[:5]) for c in cloud.calls()]
    recreated = fault == "preempted"
    assert commands.count("gcloud compute tpus queued-resources create") == 1 + recreated
    assert commands.count("gcloud compute tpus queued-resources delete") == recreated
    assert trained_on_every_host(cloud, hosts=2)
    np.testing.assert_allclose(losses(run_dir), losses(reference), rtol=0, atol=1e-5)
    records = read_jsonl(run_dir / "events.jsonl")
    report = goodput.report(records)
    assert len(report.attempts) == 2 and report.attempts[-1]["how"] == "finished" and report.relaunches == 1
    relaunch = next(r for r in records if r["event"] == "relaunch")
    second = [r for r in records if r["event"] == "attempt_start"][1]
    last_of_first = max(r.get("end", r.get("time", 0)) for r in records if r.get("attempt") == 1)
    assert last_of_first < relaunch["time"] < second["time"]
    assert report.seconds["restart_gap"] == pytest.approx(second["time"] - last_of_first)


@pytest.mark.slow
@pytest.mark.parametrize("target, topology", [("xpk", "v4-16"), ("jobset", "v4-16"), ("slurm", "gpu-8")])
def test_xpk_jobset_and_slurm_launches_train_on_every_host_to_the_end(tmp_path, shakespeare, reference, target,
                                                                      topology):
    """GKE pods (TPU_WORKER_ID / TPU_WORKER_HOSTNAMES) and Slurm tasks (SLURM_PROCID, srun one per node): 2 hosts
    of 1 device, 8 steps, the first 8 losses of the reference (one learning-rate schedule for any length)."""
    cloud = FakeCloud(tmp_path / "cloud", devices_per_host=1)
    proc = launch_on_fake_pod(cloud, tmp_path / "run", shakespeare, "--target", target, "--topology", topology,
                              "--gpus_per_node", "4", "--skip_aot", run=SHORT)
    out = proc.communicate(timeout=900)[0]
    assert proc.returncode == 0, out[-4000:]
    assert "pod: the run finished" in out
    assert trained_on_every_host(cloud, hosts=2)
    np.testing.assert_allclose(losses(tmp_path / "run"), losses(reference)[:8], rtol=0, atol=1e-5)


def test_the_docs_show_what_the_launcher_prints(monkeypatch):
    """docs/pods.md's manual commands are the dry run of its first launch command (the commit aside)."""
    import re

    page = (ROOT / "docs" / "pods.md").read_text()
    command = next(line for line in page.splitlines() if line.startswith("python -m tools.pod launch"))
    shown = page.split("```text\n", 1)[1].split("```", 1)[0]
    code, out, err = run_main(pod_main, *command.split()[3:])
    assert code == 0, err
    out = re.sub(r"[0-9a-f]{40}", "<commit>", re.sub(r"install [0-9a-f]{12}", "install <commit>", out))
    assert out == shown


def test_status_and_delete_reach_what_launch_created(tmp_path, monkeypatch):
    cloud = FakeCloud(tmp_path)
    monkeypatch.setenv("PATH", cloud.env()["PATH"])
    monkeypatch.setenv("FAKE_CLOUD_DIR", str(cloud.root))
    subprocess.run(["gcloud", "compute", "tpus", "queued-resources", "create", "pod", "--accelerator-type=v4-16"],
                   check=True)
    status = subprocess.run([sys.executable, "-m", "tools.pod", "status", "--name", "pod", *WHERE], cwd=ROOT,
                            capture_output=True, text=True, check=False)
    assert status.returncode == 0 and status.stdout.strip().endswith("ACTIVE")
    code, _, _ = run_main(pod_main, "delete", "--name", "pod", *WHERE)
    assert code == 0 and "pod" not in cloud.state()
    assert cloud.calls()[-1][:5] == ["gcloud", "compute", "tpus", "queued-resources", "delete"]


@pytest.mark.slow
def test_a_program_that_does_not_fit_is_refused_before_anything_is_created(tmp_path, monkeypatch):
    """The default AOT check: 1.6 B parameters and their Adam moments on every v5e chip (26 GiB of 16)."""
    cloud = FakeCloud(tmp_path / "cloud")
    monkeypatch.setenv("PATH", cloud.env()["PATH"])
    monkeypatch.setenv("FAKE_CLOUD_DIR", str(cloud.root))
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another process may hold libtpu's lock file
    code, _, err = run_main(pod_main, "launch", "--topology", "v5e-8", "--run_dir", "gs://b/r", *WHERE, *PINNED[:4],
                              "--workdir", str(tmp_path / "w"), "--", "--config", "gpt2_124m", "--model.n_layer=8",
                              "--model.n_embd=4096", "--model.n_head=32", "--model.scan_layers=true",
                              "--mesh.rules=dp")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "does not fit in HBM" in err, err
    assert cloud.calls() == [] and not (tmp_path / "w").exists()


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


def test_attach_polls_a_running_job_without_creating_anything(tmp_path, monkeypatch):
    """`launch --attach` (after a Ctrl-C) only polls: here the slice is ACTIVE and the run's last attempt has
    ended finished, so it reports the end without a create, an install or a start."""
    cloud = FakeCloud(tmp_path / "cloud")
    monkeypatch.setenv("PATH", cloud.env()["PATH"])
    monkeypatch.setenv("FAKE_CLOUD_DIR", str(cloud.root))
    subprocess.run(["gcloud", "compute", "tpus", "queued-resources", "create", "pod", "--accelerator-type=v4-16"],
                   check=True)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_text(json.dumps({"event": "attempt_start", "attempt": 1, "time": 1.0}) + "\n"
                                          + json.dumps({"event": "attempt_end", "attempt": 1, "time": 2.0,
                                                        "how": "finished"}) + "\n")
    code, out, err = run_main(pod_main, "launch", "--attach", "--topology", "v4-16", "--name", "pod", *WHERE,
                              "--run_dir", str(run_dir), "--shared_fs", *PINNED[:4], "--workdir",
                              str(tmp_path / "w"), "--poll_seconds", "0.1")
    assert code == 0 and "pod: the run finished" in out, err
    assert [c[4] for c in cloud.calls()] == ["create", "describe"]  # the test's create, the launcher's poll
