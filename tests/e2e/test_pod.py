"""tools.pod, the pod launcher, on a simulated cloud (tests/support/cloud.py: fake gcloud and friends that behave as
the real tools where it matters, hosts as local processes): the detached training on a TPU VM, the keep-alive, and
one end-to-end run per kind of platform: TPU VMs (JAX's metadata-server detection, two slices, ssh batches of one, a
preemption, the launcher killed mid-run and attached again), GKE (TPU_WORKER_*), Slurm (SLURM_*, every GPU of every
node).

The fast keep-alive tests run a stand-in for train.py (tests/support/fake_hosts/fake_train.py) on the fake hosts:
they test the launcher, not the training. The end-to-end hosts `git clone` this checkout and run its committed HEAD.
Times on the loaded 2-core machine: the fast tests ~15 s together; slow: the reference run ~25-35 s (once per
module), the TPU VM run ~50-65 s, GKE and Slurm ~15-35 s each, the refusal ~4 s.

The faults of a first real launch: tests/e2e/test_pod_faults.py. The golden files and the checks that need no
cloud: tests/unit/test_pod.py, tests/unit/test_pod_preflight.py.
"""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import train as train_app
from support.cli import ROOT, SMALL, read_jsonl, run_main
from support.cloud import use
from support.pod_runs import console_tails, following, make_tiny_repo, tiny_job, trained_on_every_host, verbs, wait_for
from tools.pod.__main__ import main as pod_main
from tools.pod.keepalive import Keeper
from trainer.telemetry import goodput

WHERE = ["--zone", "us-west4-a", "--project", "my-project"]


def host(*args, env=None, **kwargs):
    return subprocess.run([sys.executable, "-m", "tools.pod.host", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, check=True, **kwargs).stdout.strip()


def test_a_detached_training_outlives_the_session_that_started_it(tmp_path):
    """Started from a shell that is then hung up and killed with its whole session (a dropped ssh), the command
    runs to its end; its exit status and output stay behind. `stop` ends a command, which then reads as lost."""
    env = {**os.environ, "HOME": str(tmp_path), "HOSTNAME": "vm-0"}
    command = f"{sys.executable} -c \"import time; time.sleep(1.5); print('done'); raise SystemExit(3)\""
    ssh = subprocess.Popen(["bash", "-c", f"{sys.executable} -m tools.pod.host start --job=j --run_dir={tmp_path}/run"
                            f" -- {command} && sleep 60"], cwd=ROOT, env=env, start_new_session=True)
    time.sleep(0.5)
    os.killpg(ssh.pid, signal.SIGHUP)
    os.killpg(ssh.pid, signal.SIGKILL)
    ssh.wait()
    assert host("state", "--job=j", env=env) == "running"
    deadline = time.time() + 30
    while (state := host("state", "--job=j", env=env)) == "running" and time.time() < deadline:
        time.sleep(0.2)
    assert state == "3"
    assert (tmp_path / "run" / "logs" / "console.vm-0.log").read_text() == "done\n"
    host("start", "--job=k", f"--run_dir={tmp_path}/run", "--", "sleep", "60", env=env)
    assert host("state", "--job=k", env=env) == "running"
    host("stop", "--job=k", env=env)
    time.sleep(0.2)
    assert host("state", "--job=k", env=env) == "lost" and host("state", "--job=none", env=env) == "none"


def gcloud(cloud, *argv, check=True):
    return subprocess.run(["gcloud", "compute", "tpus", *argv], env=cloud.env(), check=check, capture_output=True,
                          text=True)


def test_the_fake_cloud_shows_a_command_that_reached_one_host_only(clouds):
    """The check the end-to-end tests make (`trained_on_every_host`) fails for an ssh without --worker=all."""
    cloud = clouds()
    gcloud(cloud, "queued-resources", "create", "p", "--node-id=p", "--accelerator-type=v4-16")
    gcloud(cloud, "tpu-vm", "ssh", "p", "--command=true train.py")
    assert not trained_on_every_host(cloud, hosts=2)
    gcloud(cloud, "tpu-vm", "ssh", "p", "--worker=all", "--command=true train.py")
    assert trained_on_every_host(cloud, hosts=2)


def test_the_fake_queued_resource_ssh_runs_its_batches_in_series(clouds):
    """As gcloud's queued-resources ssh: 4 hosts in batches of 2, each batch waited for before the next. A
    command that waits for a host of a later batch (a training in the foreground waits for every process to
    join) would never return."""
    cloud = clouds(ssh_batch=2)
    gcloud(cloud, "queued-resources", "create", "p", "--node-count=2", "--accelerator-type=v4-16")
    gcloud(cloud, "queued-resources", "ssh", "p", "--node=all", "--worker=all",
           "--command=echo $(date +%s.%N) > started; sleep 0.3")
    homes = sorted((cloud.root / "vms").glob("p-1/slice-*/worker-*"))
    started = [float((h / "started").read_text()) for h in homes]  # slice 0's two hosts, then slice 1's
    assert len(started) == 4 and max(started[:2]) + 0.3 <= min(started[2:])


@pytest.fixture(scope="module")
def tiny_repo(tmp_path_factory):
    """What the fast tests' hosts clone: this checkout's tools/pod/host.py and train.py's stand-in."""
    return make_tiny_repo(tmp_path_factory.mktemp("tiny_repo"))


def test_state_errors_relaunch_nothing_and_an_attached_launcher_creates_nothing(tiny_repo, tmp_path, clouds,
                                                                                 monkeypatch, capsys):
    """Two `describe` calls fail as an API error does, then it answers: no delete, no relaunch. A second
    launcher attached to the running job follows it to its end without creating or starting anything."""
    cloud = use(clouds(), monkeypatch)
    job = tiny_job(tiny_repo, tmp_path)
    (tmp_path / "run" / "hold").touch()
    Keeper(job).bring_up()
    started = len(cloud.calls())
    cloud.fail_next(2)
    thread, result = following(Keeper(job))  # as `launch --attach`
    wait_for(lambda: (cloud.root / "flaky").read_text() == "0", "the failing describes")
    (tmp_path / "run" / "hold").unlink()
    thread.join(60)
    assert result == {"code": 0}, capsys.readouterr()
    out = capsys.readouterr().out
    assert "its state could not be read (ERROR: (gcloud.compute.tpus.queued-resources.describe) There was a problem" \
           " refreshing your current auth tokens: UNAVAILABLE: connection reset); the next poll asks again" in out
    assert "pod: the run finished" in out
    assert verbs(cloud).count("queued-resources create") == 1 and "queued-resources delete" not in verbs(cloud)
    assert {c[3] for c in cloud.calls()[started:]} == {"queued-resources", "tpu-vm"}  # describes and state reads
    assert all("tools.pod.host state" in " ".join(c) for c in cloud.calls()[started:] if c[3] == "tpu-vm")


@pytest.mark.parametrize("loss", ["preempted", "failed", "saved"])
def test_a_lost_slice_is_created_again_and_a_failed_or_saved_training_restarts_on_its_hosts(
        tiny_repo, tmp_path, clouds, monkeypatch, capsys, loss):
    """SUSPENDED (preempted): deleted, created, installed, started again. A training that failed on a live
    slice: what is left of it stopped, then started again on the same hosts. One that saved after a SIGTERM and
    exited 0 (train.py today) too: its host records 42, which the launcher acts on without reading the run
    directory (here it cannot: no gs:// credentials on the launcher's machine)."""
    cloud = use(clouds(), monkeypatch)
    monkeypatch.setattr("tools.pod.keepalive.attempt_end", lambda run_dir, since: None)
    job = tiny_job(tiny_repo, tmp_path)
    run = tmp_path / "run"
    {"failed": run / "exit", "saved": run / "preempt", "preempted": run / "hold"}[loss].write_text("1")
    keeper = Keeper(job)
    keeper.bring_up()
    thread, result = following(keeper)
    if loss == "preempted":
        cloud.preempt("pod")
        wait_for(lambda: verbs(cloud).count("queued-resources create") == 2, "the new slice")
        (run / "hold").unlink()
    thread.join(60)
    assert result == {"code": 0}, capsys.readouterr()
    created, stops = verbs(cloud).count("queued-resources create"), [
        r for r in cloud.worker_runs() if "tools.pod.host stop" in r["command"]]
    assert (created, len(stops)) == ((2, 0) if loss == "preempted" else (1, 1))
    out = capsys.readouterr().out
    assert "relaunch 1 of 1" in out
    assert ("the training was preempted and saved its checkpoint; relaunch 1" in out) == (loss == "saved")
    ends = [r["how"] for r in read_jsonl(run / "events.jsonl") if r["event"] == "attempt_end"]
    assert ends == {"failed": ["failed", "finished"], "saved": ["preempted", "finished"],
                    "preempted": ["finished"]}[loss]
    assert [r["number"] for r in read_jsonl(run / "events.jsonl") if r["event"] == "relaunch"] == [1]


@pytest.mark.parametrize("retries", [1, 0])
def test_jobset_restarts_are_its_own_and_its_state_errors_change_nothing(tiny_repo, tmp_path, clouds, monkeypatch,
                                                                         capsys, retries):
    """`kubectl get` failing twice changes nothing; a pod that fails makes JobSet restart every pod
    (maxRestarts), not the launcher: one owner of the restarts. Its restarts spent, the Failed JobSet is
    reported in one line with the delete command."""
    cloud = use(clouds(), monkeypatch)
    job = tiny_job(tiny_repo, tmp_path, target="jobset", retries=retries)
    (tmp_path / "run" / "exit").write_text("1")
    (tmp_path / "run" / "hold").touch()
    keeper = Keeper(job)
    keeper.write_files()
    keeper.bring_up()
    cloud.fail_next(2)
    thread, result = following(keeper)
    wait_for(lambda: (cloud.root / "flaky").read_text() == "0", "the failing kubectl calls")
    (tmp_path / "run" / "hold").unlink()
    thread.join(60)
    err = capsys.readouterr().err
    assert verbs(cloud).count("kubectl apply -f") == 1 and not any("delete" in v for v in verbs(cloud))
    ends = [r["how"] for r in read_jsonl(tmp_path / "run" / "events.jsonl") if r["event"] == "attempt_end"]
    if retries:
        assert result == {"code": 0} and ends == ["failed", "finished"], err
        return
    assert result == {"code": 1} and ends == ["failed"]
    assert "the JobSet failed after its restarts (maxRestarts 0)" in err and len(err.strip().splitlines()) == 1
    assert "; the JobSet pod may exist; delete it with: python -m tools.pod delete --target jobset --name pod" in err


# the TPU VM run: 16 steps before its preemption at checkpoint 16, 16 after it (the launcher is killed meanwhile);
# two saves, not four: each costs a 2-process job seconds here, and the losses do not depend on them
RUN = [*SMALL, "--train.steps=32", "--train.eval_every=0", "--checkpoint.every=16", "--mesh.fsdp=2"]


SHORT = [*RUN, "--train.steps=8"]  # its first 8 steps: one learning-rate schedule for any length (SMALL)


def launch_on_fake_pod(cloud, run_dir, shakespeare, *flags, run=RUN, verb="launch"):
    """tools.pod launch on the fake cloud (a 2-host v4-16 unless --topology); hosts clone this checkout."""
    topology = [] if "--topology" in flags else ["--topology", "v4-16"]
    cmd = [sys.executable, "-m", "tools.pod", verb, *topology, "--name", "pod", *WHERE, "--cluster", "c",
           "--run_dir", str(run_dir), "--shared_fs", "--repo", str(ROOT), "--workdir", str(cloud.root / "w"),
           "--poll_seconds", "0.5", *flags, "--", f"--data.cache_dir={shakespeare}", *run]
    env = {**cloud.env(), "PYTHONPATH": str(ROOT), "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}  # the AOT check beside
    # another user of libtpu on this machine (as tests/e2e/test_aot.py)
    return subprocess.Popen(cmd, cwd=cloud.root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # (Slurm's submit directory, where the install goes)


def losses(run_dir):
    return [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


def events(run_dir, kind):
    path = run_dir / "events.jsonl"
    return [r for r in read_jsonl(path) if r["event"] == kind] if path.exists() else []


@pytest.fixture(scope="module")
def reference(tmp_path_factory, shakespeare):
    """The same run uninterrupted, one process of 8 devices."""
    run_dir = tmp_path_factory.mktemp("reference")
    code, _, err = run_main(train_app.main, "--run_dir", str(run_dir), f"--data.cache_dir={shakespeare}", *RUN)
    assert code == 0, err[-3000:]
    return run_dir


def test_a_tpu_vm_pod_trains_detached_through_a_preemption_and_a_lost_launcher(tmp_path, shakespeare, reference,
                                                                               clouds):
    """Two single-host slices (queued resources, one ssh batch per host), each host finding its place in the job
    through its metadata server, as JAX does on a TPU VM. At checkpoint 16 the slices are preempted: deleted,
    created, installed and started again by the launcher; then the launcher itself is killed (a closed laptop).
    The hosts train on to the end; a launcher attached afterwards reports it. The losses are the uninterrupted
    run's."""
    cloud = clouds(devices_per_host=2, ssh_batch=1)
    run_dir = tmp_path / "run"
    proc = launch_on_fake_pod(cloud, run_dir, shakespeare, "--topology", "v4-8", "--num_slices", "2", "--retries",
                              "1", "--skip_aot")
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "16").exists() or proc.poll() is not None, "checkpoint 16", 600)
        assert proc.poll() is None, proc.stdout.read()[-4000:] + console_tails(run_dir)
        cloud.preempt("pod")
        wait_for(lambda: len(events(run_dir, "attempt_start")) == 2 or proc.poll() is not None, "the relaunch", 600)
    finally:
        proc.kill()
        out = proc.communicate()[0]
    assert "finished" not in [r["how"] for r in events(run_dir, "attempt_end")]  # the hosts outlive the launcher
    assert "relaunch 1 of 1" in out and "training on every host, detached" in out, out[-4000:] + console_tails(run_dir)
    wait_for(lambda: [r["how"] for r in events(run_dir, "attempt_end")][-1:] == ["finished"], "the hosts", 600)
    attach = launch_on_fake_pod(cloud, run_dir, shakespeare, "--topology", "v4-8", "--num_slices", "2", "--attach")
    out = attach.communicate(timeout=120)[0]
    assert attach.returncode == 0 and "pod: the run finished" in out, out[-4000:] + console_tails(run_dir)
    np.testing.assert_allclose(losses(run_dir), losses(reference), rtol=0, atol=1e-5)
    commands = [" ".join(c[1:5]) for c in cloud.calls()]
    assert commands.count("compute tpus queued-resources create") == 2
    assert commands.count("compute tpus queued-resources delete") == 1
    assert trained_on_every_host(cloud, hosts=2)  # (two slices of one host: workers 0 and 1 of the job)
    assert sorted(p.name for p in (run_dir / "logs").glob("console.*.log")) == ["console.pod-0-w-0.log",
                                                                                "console.pod-1-w-0.log"]
    report = goodput.report(read_jsonl(run_dir / "events.jsonl"))
    assert len(report.attempts) == 2 and report.relaunches == 1 and report.attempts[-1]["how"] == "finished"


@pytest.mark.parametrize("target, topology", [("jobset", "v4-16"), ("slurm", "gpu-4")])
def test_gke_and_slurm_hosts_find_their_place_and_train_on_every_device(tmp_path, shakespeare, reference, clouds,
                                                                         target, topology):
    """GKE pods (TPU_WORKER_ID / TPU_WORKER_HOSTNAMES), Slurm tasks (SLURM_*, one per node of 2 GPUs: every GPU of
    every node must be in the mesh): JAX's own detection forms the job, to the reference's first 8 losses. Slurm's
    job is followed by its id. 2 CPU devices per host, as the TPU VM run's: the train call that run compiled."""
    cloud = clouds(devices_per_host=None if target == "slurm" else 2)
    proc = launch_on_fake_pod(cloud, tmp_path / "run", shakespeare, "--target", target, "--topology", topology,
                              "--gpus_per_node", "2", "--skip_aot", run=SHORT)
    out = proc.communicate(timeout=900)[0]
    assert proc.returncode == 0, out[-4000:]
    assert "pod: the run finished" in out
    assert trained_on_every_host(cloud, hosts=2)
    logs = cloud.root.glob("pod-*.log") if target == "slurm" else (cloud.root / "pods").glob("*/host-0/out.log")
    console = "".join(p.read_text() for p in logs)  # (sbatch --output, in the submit directory; a pod's log)
    assert "mesh     4 × cpu: data 2 × fsdp 2" in console, console[-3000:]
    np.testing.assert_allclose(losses(tmp_path / "run"), losses(reference)[:8], rtol=0, atol=1e-5)
    if target == "slurm":
        job_id = (cloud.root / "w" / "pod.jobid").read_text().strip()
        assert ["squeue", "-h", f"--jobs={job_id}", "--states=all", "-o", "%T"] in cloud.calls()


def test_status_and_delete_reach_what_launch_created(clouds, monkeypatch):
    cloud = use(clouds(), monkeypatch)
    gcloud(cloud, "queued-resources", "create", "pod", "--node-id=pod", "--accelerator-type=v4-16")
    status = subprocess.run([sys.executable, "-m", "tools.pod", "status", "--name", "pod", *WHERE], cwd=ROOT,
                            capture_output=True, text=True, check=False)
    assert status.returncode == 0 and status.stdout.strip().endswith("ACTIVE")
    code, _, _ = run_main(pod_main, "delete", "--name", "pod", *WHERE)
    assert code == 0 and "pod" not in cloud.state()
    assert cloud.calls()[-1][:5] == ["gcloud", "compute", "tpus", "queued-resources", "delete"]


def test_a_program_that_does_not_fit_is_refused_before_anything_is_created(tmp_path, monkeypatch, clouds):
    """The default AOT check: 1.6 B parameters and their Adam moments on every v5e chip (26 GiB of 16)."""
    cloud = use(clouds(), monkeypatch)
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another process may hold libtpu's lock file
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    code, _, err = run_main(pod_main, "launch", "--topology", "v5e-8", "--run_dir", "gs://b/r", *WHERE, "--repo",
                            str(ROOT), "--commit", head, "--workdir", str(tmp_path / "w"), "--", "--config",
                            "gpt2_124m", "--model.n_layer=8",
                            "--model.n_embd=4096", "--model.n_head=32", "--model.scan_layers=true", "--mesh.rules=dp")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "does not fit in HBM" in err, err
    assert not any(c[0] == "gcloud" and "create" in c for c in cloud.calls()) and not (tmp_path / "w").exists()
