"""The pod launcher's first real launch, on a simulated cloud made as unkind as the real tools' sources say
(tests/support/cloud.py, cloud_gke.py, cloud_slurm.py, fake_hosts/image.py): each fault is first shown with what the
launcher did before (the command or script it emitted), then met by what it does now.

1. A TPU VM's python3 is 3.10 without its venv module: uv's Python 3.11 is installed instead.
2. xpk's clusters are regional: a zonal get-credentials answers 404; the location is looked up, as xpk does.
4. A host whose install fails once is tried again; one that always fails ends the launch in one line with the
   delete command (or the deletion); a relaunch that fails is one more attempt, not the launcher's end.
5. Slurm without select/cons_tres, with 1 CPU and little memory per task by default, and without sacct.
6. A preemption that saves and exits 0: JobSet takes it for Completed; now it is 42 and restarted, on every target.
7. gcloud logged out mid-run: the keep-alive ends in one line instead of polling blind.
8. A gs:// console log follows the run and survives a lost VM.
(3, the code the hosts fetch, and the checks before anything is created: tests/unit/test_pod_preflight.py.)

The hosts clone a tiny repository (tests/support/pod_runs.py): these test the launcher, not the training.
"""

import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import urllib.parse
import urllib.request

import pytest

from support import gcs as gcs_support
from support.cli import ROOT, read_jsonl, run_main
from support.cloud import use
from support.pod_runs import following, make_tiny_repo, tiny_job, verbs, wait_for
from tools.pod.__main__ import main as pod_main
from tools.pod.keepalive import Keeper
from tools.pod.targets import UNKNOWN, state_of


@pytest.fixture(scope="module")
def tiny_repo(tmp_path_factory):
    return make_tiny_repo(tmp_path_factory.mktemp("tiny_repo"))


def sh(cloud, command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], env=cloud.env(), capture_output=True, text=True, check=False)


def ends(tmp_path) -> list[str]:
    return [r["how"] for r in read_jsonl(tmp_path / "run" / "events.jsonl") if r["event"] == "attempt_end"]


def test_the_image_python_cannot_install_the_project_and_uv_python_can(tiny_repo, tmp_path, clouds):
    """Before: `python3 -m venv` with the image's python3 failed on every VM (gcloud names each worker). Now:
    uv, from pip's user site, makes .venv on its own Python 3.11."""
    cloud = clouds()
    job = tiny_job(tiny_repo, tmp_path, topology="v4-16")
    sh(cloud, "gcloud compute tpus queued-resources create pod --node-id=pod --accelerator-type=v4-16")
    ssh = "gcloud compute tpus tpu-vm ssh pod --worker=all --command="
    before = sh(cloud, ssh + "'set -e; python3 -m venv .venv; .venv/bin/pip install -q -e .'")
    assert before.returncode == 1 and "ensurepip is not" in before.stdout
    assert "##### Command execution on worker 1 failed with exit status 1" in before.stderr
    now = sh(cloud, ssh + shlex.quote(job.install_command()))
    assert now.returncode == 0, now.stdout + now.stderr
    version = sh(cloud, ssh + "'gpt2-nnx/.venv/bin/python -c \"import sys; print(sys.version_info >= (3, 11))\"'")
    assert version.stdout.count("True") == 2 and "-q --python .venv/bin/python -e .[tpu,gcs]" in \
        (cloud.root / "pip.log").read_text()


@pytest.mark.parametrize("times", [1, -1])
def test_a_failed_install_is_tried_again_and_one_that_always_fails_ends_in_one_line(
        tiny_repo, tmp_path, clouds, monkeypatch, capsys, times):
    """Worker 1's package index answers 503 once: the install runs again (on every host: it may) and the launch
    goes on. Always: after 3 tries, one line naming worker 1, what it said, and the slice left up with its delete
    command; with --delete_on_failure, the same end deletes it."""
    cloud = use(clouds(), monkeypatch)
    cloud.fail_install("pod-0-w-1", times)
    job = tiny_job(tiny_repo, tmp_path, topology="v4-16")
    code = Keeper(job).launch()
    out, err = capsys.readouterr()
    installs = [r for r in cloud.worker_runs() if "pip install -q --python" in r["command"] and r["worker"] == 1]
    if times == 1:
        assert code == 0 and [r["status"] for r in installs] == [2, 0], out
        assert "the install on the hosts failed (worker 1 exited 2: [0/1]   Caused by: HTTP status server error (503" \
               in out and "trying again in 0.05 s (2 of 3)" in out
        return
    assert code == 1 and len(installs) == 3 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: pod: the install on the hosts failed after 3 tries (worker 1 exited 2: [0/1]  "
                          " Caused by: HTTP status server error (503 Service Unavailable)")
    assert err.strip().endswith("; the slice (queued resource) pod is still up, and billed; delete it with:"
                                " python -m tools.pod delete --target tpu-vm --name pod --zone us-west4-a"
                                " --project p") and "pod" in cloud.state()
    assert "train.py" not in " ".join(r["command"] for r in cloud.worker_runs())
    assert Keeper(dataclasses.replace(job, delete_on_failure=True)).give_up("the install failed") == 1
    assert capsys.readouterr().err.strip().endswith("; deleted it (--delete_on_failure)") and not cloud.state().get("pod")


def test_a_relaunch_whose_install_fails_is_one_more_attempt(tiny_repo, tmp_path, clouds, monkeypatch, capsys):
    """The training fails; its relaunch meets a package index down (one try per step here): a warning, and the
    next poll relaunches again (it no longer ends the keep-alive)."""
    cloud = use(clouds(), monkeypatch)
    job = tiny_job(tiny_repo, tmp_path, retries=2, tries=1)
    (tmp_path / "run" / "exit").write_text("1")
    (tmp_path / "run" / "hold").touch()
    keeper = Keeper(job)
    keeper.bring_up()
    cloud.fail_install("pod-0-w-0", 1)
    thread, result = following(keeper)
    (tmp_path / "run" / "hold").unlink()
    thread.join(60)
    out, err = capsys.readouterr()
    assert result == {"code": 0}, out + err
    assert "warning: pod: relaunch 1 failed: the install on the hosts failed (exit status 2: [0/0]   Caused by: HTTP" \
           " status server error (503" in err and "relaunch 2 of 2" in out
    assert ends(tmp_path) == ["failed", "finished"]


@pytest.mark.parametrize("target", ["jobset", "xpk"])
def test_a_regional_cluster_is_found_where_xpk_made_it(tiny_repo, tmp_path, clouds, monkeypatch, target):
    """Before: `get-credentials --zone` of the regional cluster xpk made answered 404 and the launch stopped.
    Now jobset asks the cluster's location first (as xpk does), and xpk's launch leaves credentials to xpk."""
    cloud = use(clouds(), monkeypatch)
    assert "code=404" in sh(cloud, "gcloud container clusters get-credentials c --zone=us-west4-a --project=p").stderr
    before, (repo, commit) = len(cloud.calls()), tiny_repo
    code, out, err = run_main(pod_main, "launch", "--target", target, "--cluster", "c", "--topology", "v4-16",
                              "--zone", "us-west4-a", "--project", "p", "--name", "pod", "--repo", str(repo),
                              "--commit", commit, "--run_dir", str(tmp_path / "run"), "--shared_fs", "--skip_aot",
                              "--workdir", str(tmp_path / "w"), "--poll_seconds", "0.05")
    assert code == 0 and "pod: the run finished" in out, out + err
    credentials = [c for c in cloud.calls()[before:] if "get-credentials" in c]
    assert credentials == ([] if target == "xpk" else [["gcloud", "container", "clusters", "get-credentials", "c",
                                                        "--location=us-west4", "--project=p"]])
    assert ["gcloud", "container", "clusters", "list", "--project=p", "--filter=name=c",
            "--format=value(location)"] in cloud.calls()


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_saved_preemption_restarts_the_jobset(tiny_repo, tmp_path, clouds, monkeypatch, capsys, wrapped):
    """train.py saves after a SIGTERM and exits 0. Before (the container ran it directly): every pod exited 0,
    JobSet called it Completed and never restarted it. Now the pod exits 42: JobSet restarts it to the end."""
    cloud = use(clouds(), monkeypatch)
    if not wrapped:
        monkeypatch.setattr("tools.pod.job.Job.train_command", lambda job: f"cd gpt2-nnx && {job.train_argv()}")
    job = tiny_job(tiny_repo, tmp_path, target="jobset", retries=1)
    (tmp_path / "run" / "preempt").touch()
    keeper = Keeper(job)
    keeper.write_files()
    keeper.bring_up()
    code = keeper.follow()
    err = capsys.readouterr().err
    if not wrapped:
        assert code == 1 and ends(tmp_path) == ["preempted"] and "its pods exited 0 instead of 42" in err
        return
    assert code == 0 and ends(tmp_path) == ["preempted", "finished"], err
    assert verbs(cloud).count("kubectl apply -f") == 1  # JobSet's own restart


def test_slurm_asks_for_the_node_portably_and_is_followed_without_sacct(tiny_repo, tmp_path, clouds, monkeypatch,
                                                                        capsys):
    """Before: `--gpus-per-node` is refused where select/cons_tres is not configured, a job without --mem or
    --exclusive is OOM-killed at start-up, and once squeue forgets a job its state, with sacct disabled, is
    unknown forever. Now: --gres, the whole node, every CPU for the task, and the script's own end record; a
    saved preemption (42) is submitted again and finishes."""
    cloud = use(clouds(), monkeypatch)
    monkeypatch.chdir(tmp_path)  # the submit directory
    (tmp_path / "old.sbatch").write_text("#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --gpus-per-node=1\ntrue\n")
    assert "Invalid generic resource (gres)" in sh(cloud, "sbatch --parsable old.sbatch").stderr
    (tmp_path / "old.sbatch").write_text("#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --gres=gpu:1\n"
                                         "#SBATCH --output=old.log\nsrun bash -c true\n")
    job_id = sh(cloud, "sbatch --parsable old.sbatch").stdout.split(";")[0]
    wait_for(lambda: "oom_kill" in (tmp_path / "old.log").read_text() if (tmp_path / "old.log").exists() else False,
             "the OOM kill")
    old_state = sh(cloud, f"squeue -h -j {job_id} -o %T 2>/dev/null | grep . || sacct -n -X -P -j {job_id} -o State")
    assert state_of("slurm", old_state.returncode, old_state.stdout, old_state.stderr) == UNKNOWN

    job = tiny_job(tiny_repo, tmp_path, target="slurm", retries=1)
    (tmp_path / "run" / "preempt").touch()
    keeper = Keeper(job)
    keeper.write_files()
    keeper.bring_up()
    assert keeper.follow() == 0, capsys.readouterr()
    assert ends(tmp_path) == ["preempted", "finished"] and [c[0] for c in cloud.calls()].count("sbatch") == 4
    assert "the training was preempted and saved its checkpoint; relaunch 1 of 1" in capsys.readouterr().out
    tasks = [r for r in cloud.worker_runs() if "train.py" in r["command"]]
    assert [r["cpus"] for r in tasks] == [os.cpu_count()] * 2


def test_a_logged_out_gcloud_ends_the_keepalive_in_one_line(tiny_repo, tmp_path, clouds, monkeypatch, capsys):
    """gcloud logged out mid-run: every state read fails. Before, one line and polling blind for days; now two
    polls, then one line that names gcloud's complaint, that the job runs on unwatched, and what to run."""
    cloud = use(clouds(), monkeypatch)
    job = tiny_job(tiny_repo, tmp_path)
    (tmp_path / "run" / "hold").touch()
    keeper = Keeper(job)
    keeper.bring_up()
    cloud.log_out()
    assert keeper.follow() == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "You do not currently have an active account selected" in err
    assert "unwatched and never relaunched; follow it again with the same launch command and --attach" in err
    assert "delete it with: python -m tools.pod delete --target tpu-vm --name pod" in err
    (tmp_path / "run" / "hold").unlink()


def test_a_gs_console_log_follows_the_run_and_survives_a_lost_vm(gcs, tmp_path):
    """The supervisor copies a gs:// run's console log while the command runs (here every 0.2 s; 30 s by
    default); the VM lost (its processes killed -9), the copy stays; a VM created again continues it."""
    name = "run/logs/console.vm-0.log"
    url = f"{gcs}/storage/v1/b/{gcs_support.BUCKET}/o/{urllib.parse.quote(name, safe='')}?alt=media"

    def copied() -> str:
        return urllib.request.urlopen(url).read().decode() if gcs_support.object_exists(gcs, name) else ""

    def vm(home: str, words: str) -> subprocess.Popen:
        env = {**os.environ, "HOME": str(tmp_path / home), "HOSTNAME": "vm-0", "PYTHONPATH": str(ROOT)}
        command = f"echo {words}; sleep 60"
        return subprocess.Popen([sys.executable, "-m", "tools.pod.host", "run", "--job=j",
                                 f"--run_dir={gcs_support.gs('run')}", "--log_every=0.2", "--", "bash", "-c",
                                 command], env=env, start_new_session=True)

    first = vm("vm-a", "before the preemption")
    wait_for(lambda: copied() == "before the preemption\n", "the first copy", 30)
    os.killpg(first.pid, signal.SIGKILL)  # the VM is gone
    first.wait()
    assert copied() == "before the preemption\n"
    second = vm("vm-b", "after it")
    try:
        wait_for(lambda: copied() == "before the preemption\nafter it\n", "the continued copy", 30)
    finally:
        os.killpg(second.pid, signal.SIGKILL)
        second.wait()
