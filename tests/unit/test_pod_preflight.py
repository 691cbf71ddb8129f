"""tools.pod's checks before anything is created (tools/pod/preflight.py), against the simulated cloud's tools
(tests/support/cloud.py) and local git repositories: each bad input is one line, before the ahead-of-time compile
(these launches do not skip it: a check that let them through would compile for a TPU) and before any call that
creates something. The code the hosts fetch: an ssh remote, a repository they cannot fetch anonymously, an
unpushed commit."""

import subprocess

import pytest

from errors import ConfigError
from support.cli import run_main
from support.cloud import use
from support.pod_runs import git, make_tiny_repo
from tools.pod.__main__ import main as pod_main
from tools.pod.preflight import check_code, hosts_url

WHERE = ["--zone", "us-west4-a", "--project", "p"]


@pytest.fixture
def repo(tmp_path):
    return make_tiny_repo(tmp_path / "repo")


def launch(tmp_path, repo, *flags):
    path, commit = repo
    return run_main(pod_main, "launch", "--name", "pod", "--run_dir", "gs://b/r", "--repo", str(path), "--commit",
                    commit, "--workdir", str(tmp_path / "w"), *flags)


def refused(cloud, tmp_path, result, message):
    code, _, err = result
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert message in err, err
    assert not any(w in c for c in cloud.calls() for w in ("create", "apply", "ssh")) and not (tmp_path / "w").exists()


@pytest.mark.parametrize("flags, fault, message", [
    (["--topology", "v4-16", *WHERE], "logged out",
     "error: gcloud cannot act for you here (`gcloud auth print-access-token --quiet`: ERROR: (gcloud.auth.print-"
     "access-token) You do not currently have an active account selected.); log in: gcloud auth login"),
    (["--topology", "v4-16", *WHERE], "no gcloud", "error: --target tpu-vm needs gcloud on PATH"),
    (["--target", "slurm", "--topology", "gpu-8", "--run_dir", "/shared/r", "--shared_fs"], "no sbatch",
     "error: --target slurm needs sbatch on PATH"),
    (["--topology", "v5e-256", *WHERE], "",
     "error: --topology: zone us-west4-a offers no v5litepod-256 (ERROR: (gcloud.compute.tpus.tpu-vm.accelerator-"
     "types.describe) NOT_FOUND"),
    (["--topology", "v4-16", "--runtime_version", "tpu-vm-tf-2.0", *WHERE], "",
     "error: --runtime_version: zone us-west4-a offers no tpu-vm-tf-2.0"),
    (["--target", "xpk", "--cluster", "elsewhere", "--topology", "v4-16", *WHERE], "",
     "error: --cluster elsewhere: no such GKE cluster in project p; create it (xpk cluster create)"),
])
def test_a_tool_that_cannot_act_or_a_place_that_lacks_the_slice_is_one_line_before_the_compile(
        tmp_path, monkeypatch, clouds, repo, flags, fault, message):
    cloud = use(clouds(), monkeypatch)
    if fault == "logged out":
        cloud.log_out()
    elif fault:
        (cloud.bin / fault.split()[1]).unlink()  # (this machine may have its own gcloud: not on this PATH)
        monkeypatch.setenv("PATH", str(cloud.bin))
    refused(cloud, tmp_path, launch(tmp_path, repo, *flags), message)


def test_an_unpushed_commit_is_refused_and_a_pushed_one_behind_a_tip_is_not(tmp_path, monkeypatch, clouds):
    """The hosts `git checkout` the commit after cloning --repo: one only this checkout has would fail there, on
    every host, after the slice exists."""
    cloud = use(clouds(), monkeypatch)
    origin, pushed = make_tiny_repo(tmp_path / "origin")
    work = tmp_path / "work"
    subprocess.run(["git", "clone", "-q", str(origin), str(work)], check=True)
    (work / "more.txt").write_text("not pushed\n")
    git(work, "add", ".")
    git(work, "commit", "-qm", "local only")
    unpushed = git(work, "rev-parse", "HEAD")
    git(origin, "commit", "-q", "--allow-empty", "-m", "the tip moves on")
    check_code(str(origin), pushed, local=work)  # behind origin's tip, on this checkout's origin/master
    with pytest.raises(ConfigError, match="is not on .*origin .no branch or tag there holds it, as far as this"
                                          " checkout knows.: push it first"):
        check_code(str(origin), unpushed, local=work)
    refused(cloud, tmp_path, launch(tmp_path, (origin, unpushed), "--topology", "v4-16", *WHERE),
            f"error: --commit {unpushed[:12]} is not on {origin}")


def test_the_hosts_clone_over_https_without_credentials(tmp_path, monkeypatch):
    """An ssh remote becomes its https URL (no host has this machine's key); a repository the hosts cannot
    fetch anonymously (private, or absent) is refused. GitHub here is a folder (git's url.<base>.insteadOf)."""
    assert hosts_url("git@github.com:you/gpt2-nnx.git") == "https://github.com/you/gpt2-nnx.git"
    assert hosts_url("ssh://git@gitlab.example.com:2222/team/gpt2.git") == "https://gitlab.example.com/team/gpt2.git"
    assert hosts_url("https://github.com/you/gpt2-nnx") == "https://github.com/you/gpt2-nnx"
    assert hosts_url("/srv/git/gpt2-nnx") == "/srv/git/gpt2-nnx"
    with pytest.raises(ConfigError, match="the hosts have no ssh key to clone it with; give a URL they fetch"
                                          " anonymously, e.g. https://github.com/you/private.git"):
        check_code("git@github.com:you/private.git", "0" * 40)
    _, public = make_tiny_repo(tmp_path / "github" / "you" / "public")
    for key, value in (("GIT_CONFIG_COUNT", "1"), ("GIT_CONFIG_KEY_0", f"url.{tmp_path}/github/.insteadOf"),
                       ("GIT_CONFIG_VALUE_0", "https://github.com/")):
        monkeypatch.setenv(key, value)
    check_code("https://github.com/you/public", public)
    with pytest.raises(ConfigError, match="--repo https://github.com/you/private: the hosts could not fetch it, nor"
                                          " can this machine without credentials .git ls-remote: "):
        check_code("https://github.com/you/private", public)
