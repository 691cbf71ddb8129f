"""What a launch checks from this machine before anything is created (and before the ahead-of-time compile), each
failure one line that says what to do:
- the tools the target drives are installed and can act: gcloud logged in (`gcloud auth print-access-token`
  refreshes the token, so a login that needs renewing fails here, not mid-run), kubectl reaching a cluster that
  has JobSet, xpk, sbatch;
- the code the hosts fetch: `--repo` cloned anonymously, as the hosts clone it (`git ls-remote` with no
  credential helper and no prompt), and `--commit` on it (a branch or tag tip, or an ancestor of one);
- where the job goes: the GKE cluster exists, at which location (xpk's own lookup, gcloud_context.py); the zone
  offers the TPU slice and its runtime image.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from pathlib import Path

from errors import ConfigError
from tools.pod.job import RUNTIME_VERSIONS, Job
from tools.pod.shell import quietly

TOOLS = {"tpu-vm": ("gcloud",), "xpk": ("xpk", "gcloud", "kubectl"), "jobset": ("kubectl",),
         "slurm": ("sbatch", "squeue", "scancel")}
GCLOUD_AUTH = "gcloud auth print-access-token --quiet >/dev/null"
KUBECTL_JOBSETS = "kubectl get jobsets.jobset.x-k8s.io -o name --request-timeout=30s >/dev/null"
GIT_TIMEOUT_S = 60


def checks(job: Job) -> list[str]:
    """The commands the checks run, for --dry_run."""
    w, out = job.where, [f"(on PATH: {', '.join(tools(job))})"]
    if "gcloud" in tools(job):
        out.append(GCLOUD_AUTH)
    if w.target == "jobset" and not w.cluster:
        out.append(KUBECTL_JOBSETS)
    if on_gke_cluster(job):
        out.append(f"{cluster_list_command(job)}   (the cluster's location; --dry_run shows its region, where xpk"
                   " creates clusters)")
    if w.target == "tpu-vm":
        out += zone_commands(job)
    out.append(f"git ls-remote {job.repo}   (as the hosts fetch it: anonymously; {job.commit[:12]} must be on it)")
    return out


def preflight(job: Job, local: Path | None = None, *, tools_only: bool = False) -> Job:
    """Every check (`local`: the checkout that knows the commit's history); the job with its cluster's location
    found. `tools_only`: a launcher attaching to a job that exists."""
    check_tools(job)
    if tools_only:
        return job
    check_code(job.repo, job.commit, local)
    if on_gke_cluster(job):
        job = dataclasses.replace(job, cluster_location=cluster_location(job))
    if job.where.target == "tpu-vm":
        check_zone(job)
    return job


def on_gke_cluster(job: Job) -> bool:
    """xpk, or jobset given --cluster: a GKE cluster that gcloud finds."""
    return job.where.target in ("xpk", "jobset") and bool(job.where.cluster)


def tools(job: Job) -> tuple[str, ...]:
    return TOOLS[job.where.target] + (("gcloud",) if job.where.target == "jobset" and job.where.cluster else ())


def check_tools(job: Job) -> None:
    missing = [t for t in tools(job) if shutil.which(t) is None]
    if missing:
        raise ConfigError(f"--target {job.where.target} needs {', '.join(missing)} on PATH, and none is there:"
                          " install it (and log in) on this machine first")
    if "gcloud" in tools(job):
        _must(GCLOUD_AUTH, "gcloud cannot act for you here", "log in: gcloud auth login")
    if job.where.target == "jobset" and not job.where.cluster:
        _must(KUBECTL_JOBSETS, "kubectl cannot list JobSets in its current context",
              "point kubectl at a cluster with JobSet installed (or give --cluster, --zone and --project)")


def _must(command: str, what: str, todo: str) -> None:
    r = quietly(command)
    if r.returncode != 0:
        said = next((line.strip() for line in r.stderr.splitlines() if line.strip()), f"exit status {r.returncode}")
        raise ConfigError(f"{what} (`{command.split(' >', 1)[0]}`: {said[:200]}); {todo}")


# ---- the code the hosts fetch ----------------------------------------------------------------------------


def hosts_url(url: str) -> str:
    """The URL hosts can clone: an ssh remote (`git@host:path`, `ssh://[user@]host/path`) becomes https, since
    no host has this machine's ssh key; others as they are."""
    m = re.fullmatch(r"(?:ssh://)?(?:[^@/]+@)?([^:/]+)(?::\d+)?[:/](.+)", url)
    if m and (url.startswith("ssh://") or re.match(r"[^@/]+@[^:/]+:", url)):
        return f"https://{m.group(1)}/{m.group(2).lstrip('/')}"
    return url


def check_code(repo: str, commit: str, local: Path | None = None) -> None:
    """`repo` answers an anonymous fetch and holds `commit`: a tip it lists, or, as far as the local checkout
    `local` knows, an ancestor of one, or of a remote-tracking branch (pushed; an unpushed commit is none of
    these)."""
    if hosts_url(repo) != repo:
        raise ConfigError(f"--repo {repo}: the hosts have no ssh key to clone it with; give a URL they fetch"
                          f" anonymously, e.g. {hosts_url(repo)}")
    r = _git(None, "-c", "credential.helper=", "ls-remote", repo)
    if r.returncode != 0:
        said = next((line for line in r.stderr.splitlines() if line.strip()), f"exit status {r.returncode}")
        raise ConfigError(f"--repo {repo}: the hosts could not fetch it, nor can this machine without credentials"
                          f" (git ls-remote: {said.strip()[:200]}); make it public, or give --repo a URL the hosts"
                          " can clone")
    tips = {line.split()[0] for line in r.stdout.splitlines() if line.strip()}
    if commit in tips or any(_is_ancestor(local, commit, tip) for tip in tips) or _pushed(local, commit):
        return
    raise ConfigError(f"--commit {commit[:12]} is not on {repo} (no branch or tag there holds it, as far as this"
                      " checkout knows): push it first (git push), or give --commit one that is")


def _pushed(local: Path | None, commit: str) -> bool:
    """A remote-tracking branch of the local checkout holds the commit (it was pushed, or fetched from there)."""
    if local is None:
        return False
    r = _git(local, "for-each-ref", "--contains", commit, "--format=%(refname)", "refs/remotes")
    return r.returncode == 0 and bool(r.stdout.strip())


def _is_ancestor(local: Path | None, commit: str, tip: str) -> bool:
    if local is None or _git(local, "cat-file", "-e", f"{tip}^{{commit}}").returncode != 0:
        return False
    return _git(local, "merge-base", "--is-ancestor", commit, tip).returncode == 0


def _git(where: Path | None, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "", "SSH_ASKPASS": "",
           "GIT_SSH_COMMAND": "ssh -o BatchMode=yes"}  # never a prompt: the answer the hosts would get
    cmd = ["git", *(["-C", str(where)] if where else []), *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=GIT_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, 1, "", f"no answer within {GIT_TIMEOUT_S} s")


# ---- where the job goes ------------------------------------------------------------------------------------


def cluster_list_command(job: Job) -> str:
    """xpk's own lookup of a cluster's location (core/gcloud_context.py get_cluster_location)."""
    w = job.where
    return f"gcloud container clusters list --project={w.project} --filter=name={w.cluster} --format='value(location)'"


def region_of(zone: str) -> str:
    return "-".join(zone.split("-")[:2])  # us-west4-a -> us-west4 (xpk's zone_to_region)


def cluster_location(job: Job) -> str:
    """The cluster's zone, else its region (where xpk creates clusters), as xpk picks it."""
    w = job.where
    r = quietly(cluster_list_command(job))
    if r.returncode != 0:
        raise ConfigError(f"--cluster {w.cluster}: could not list the project's GKE clusters"
                          f" ({_first(r.stderr, r.returncode)}); check --project {w.project} and your access")
    found = r.stdout.split()
    if not found:
        raise ConfigError(f"--cluster {w.cluster}: no such GKE cluster in project {w.project}; create it (xpk"
                          " cluster create) or name one that exists")
    return w.zone if w.zone in found else region_of(w.zone) if region_of(w.zone) in found else found[0]


def zone_commands(job: Job) -> list[str]:
    w = job.where
    where = f"--zone={w.zone} --project={w.project}"
    runtime = job.runtime_version or RUNTIME_VERSIONS[job.slice.generation]
    return [f"gcloud compute tpus tpu-vm accelerator-types describe {job.slice.accelerator_type} {where}"
            " --format='value(type)'",
            f"gcloud compute tpus tpu-vm versions describe {runtime} {where} --format='value(version)'"]


def check_zone(job: Job) -> None:
    """The zone offers the slice (`--topology`) and the image (`--runtime_version`)."""
    for command, flag in zip(zone_commands(job), ("--topology", "--runtime_version")):
        r = quietly(command)
        if r.returncode != 0:
            name = command.split()[6]  # gcloud compute tpus tpu-vm {accelerator-types,versions} describe NAME
            what = f"offers no {name}" if "NOT_FOUND" in r.stderr else f"could not be asked about {name}"
            raise ConfigError(f"{flag}: zone {job.where.zone} {what} ({_first(r.stderr, r.returncode)}); pick"
                              f" another --zone or {flag}")


def _first(text: str, code: int) -> str:
    return next((line.strip()[:200] for line in text.splitlines() if line.strip()), f"exit status {code}")
