"""The launcher's command line: `launch`, `delete`, `status`; every input checked before anything is created."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from errors import ConfigError, fail, warn
from tools.pod.job import Job, Where
from tools.pod.preflight import checks, hosts_url, region_of
from tools.pod.targets import TARGETS, plan
from tools.pod.topology import parse_topology

ROOT = Path(__file__).resolve().parents[2]  # the checkout whose commit the hosts install


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        fail(f"{message} (python -m tools.pod {{launch,delete,status}} --help)")


def parser() -> Parser:
    p = Parser(prog="python -m tools.pod", description=sys.modules["tools.pod"].__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = p.add_subparsers(dest="verb", required=True, parser_class=Parser)
    launch = verbs.add_parser("launch", help="compile for the topology, create the slice or job, train")
    for verb in (launch, verbs.add_parser("delete", help="delete what launch created"),
                 verbs.add_parser("status", help="the job's state")):
        verb.add_argument("--target", default="tpu-vm", help=f"one of {', '.join(TARGETS)} (default tpu-vm)")
        verb.add_argument("--name", required=verb is not launch, help="the queued resource / workload / job name")
        verb.add_argument("--zone", default="", help="tpu-vm, xpk, jobset: the Google Cloud zone")
        verb.add_argument("--project", default="", help="tpu-vm, xpk, jobset: the Google Cloud project")
        verb.add_argument("--cluster", default="", help="xpk, jobset: the GKE cluster")
        verb.add_argument("--workdir", default=None, help="where the launcher keeps this job's files and, for"
                          " slurm, its job id (default ~/.cache/gpt2_nnx/pod/NAME)")
    a = launch.add_argument
    a("--topology", required=True, help="v5e-256, v4-32, v5p-64, v6e-16 (Cloud TPU names), gpu-N (slurm)")
    a("--num_slices", type=int, default=1, help="TPU slices joined over the data-center network (multislice)")
    a("--run_dir", required=True, help="gs://bucket/path (every host writes it)")
    a("--shared_fs", action="store_true", help="--run_dir is a path mounted on every host (NFS, Lustre)")
    a("--repo", default=None, help="what hosts git clone (default: this checkout's origin)")
    a("--commit", default=None, help="the commit hosts install (default: this checkout's HEAD)")
    a("--retries", type=int, default=0, help="relaunches after a preemption or failure (xpk, jobset: JobSet's"
      " restarts)")
    a("--poll_seconds", type=float, default=60.0, help="how often the job's state is read")
    a("--spot", action="store_true", help="tpu-vm: spot capacity")
    a("--runtime_version", default="", help="tpu-vm: the TPU VM image (default: the generation's base image)")
    a("--image", default="python:3.11", help="xpk, jobset: the container image (python3 and git)")
    a("--gpus_per_node", type=int, default=8, help="slurm: GPUs per node")
    a("--tries", type=int, default=3, help="runs of a failed install or start on the hosts, in all")
    a("--backoff_seconds", type=float, default=10.0, help="the wait before a failed step's second try (doubled"
      " before each next)")
    a("--blind_seconds", type=float, default=3600.0, help="the job's state unreadable this long ends the launcher"
      " (a logged-out gcloud: two polls)")
    a("--delete_on_failure", action="store_true", help="a launch that fails deletes what it created (default:"
      " prints the delete command)")
    a("--skip_aot", action="store_true", help="do not compile for the topology first")
    a("--dry_run", action="store_true", help="print the commands and files, run nothing")
    a("--attach", action="store_true", help="poll (and relaunch) a job an earlier launch started")
    a("train_args", nargs=argparse.REMAINDER, help="-- then train.py's flags (without --run_dir)")
    return p


def where(args) -> Where:
    if args.target not in TARGETS:
        raise ConfigError(f"--target {args.target}: unknown; choose one of {', '.join(TARGETS)}")
    needs = {"tpu-vm": ("zone", "project"), "xpk": ("cluster", "zone", "project")}.get(args.target, ())
    if args.target == "jobset" and args.cluster:
        needs = ("zone", "project")  # for the cluster's credentials
    missing = [f"--{n}" for n in needs if not getattr(args, n)]
    if missing:
        raise ConfigError(f"--target {args.target} needs {' and '.join(missing)}")
    workdir = Path(args.workdir or Path.home() / ".cache" / "gpt2_nnx" / "pod" / (args.name or ""))
    return Where(args.target, args.name, args.zone, args.project, args.cluster, workdir)


def job_of(args) -> Job:
    """The Job the flags describe; every check that needs no cloud, before anything exists."""
    train_args = tuple(args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args)
    args.name = args.name or f"gpt2-{args.topology}"
    w = where(args)
    if not re.fullmatch(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?", w.name):
        raise ConfigError(f"--name {w.name}: use lower-case letters, digits and hyphens (at most 40), as Google"
                          " Cloud and Kubernetes names must")
    s = parse_topology(args.topology, w.target, args.gpus_per_node)
    check_slices(s, args.num_slices, w.target)
    if args.retries < 0 or args.tries < 1 or not min(args.poll_seconds, args.blind_seconds) > 0 \
            or args.backoff_seconds < 0:
        raise ConfigError(f"--retries {args.retries} / --tries {args.tries} / --poll_seconds {args.poll_seconds:g} /"
                          f" --blind_seconds {args.blind_seconds:g} / --backoff_seconds {args.backoff_seconds:g}:"
                          " give counts >= 0 (--tries >= 1) and times > 0")
    check_run_dir(args.run_dir, s.hosts * args.num_slices, args.shared_fs)
    if any(a == "--run_dir" or a.startswith("--run_dir=") for a in train_args):
        raise ConfigError("give --run_dir to the launcher (before --), not to train.py after --")
    check_batch(train_args, args.num_slices)
    return Job(where=w, slice=s, num_slices=args.num_slices, run_dir=args.run_dir,
               repo=args.repo or origin(), commit=args.commit or head_commit(), train_args=train_args,
               image=args.image, runtime_version=args.runtime_version, spot=args.spot, retries=args.retries,
               poll_seconds=args.poll_seconds, tries=args.tries, backoff_seconds=args.backoff_seconds,
               blind_seconds=args.blind_seconds, delete_on_failure=args.delete_on_failure,
               cluster_location=region_of(w.zone))  # xpk's dry run's guess too; tools.pod.preflight asks


def check_slices(s, num_slices: int, target: str) -> None:
    if num_slices < 1 or (num_slices > 1 and not s.is_tpu):
        raise ConfigError(f"--num_slices {num_slices}: give 1, or more for TPU slices")
    if num_slices > 1 and s.hosts == 1 and target in ("xpk", "jobset"):  # GKE's multislice: multi-host pools
        raise ConfigError(f"--num_slices {num_slices} with --topology {s.name}: GKE joins slices of several hosts"
                          f" only (its multislice needs multi-host node pools); {s.name} is one host. Give a larger"
                          " slice, or --target tpu-vm")


def check_run_dir(run_dir: str, hosts: int, shared_fs: bool) -> None:
    if run_dir.startswith("gs://") or hosts == 1 and not shared_fs:
        return
    if not shared_fs:
        raise ConfigError(f"--run_dir {run_dir} is on this machine, but the {hosts} hosts must all write the run:"
                          " give gs://bucket/path (or --shared_fs for a path every host mounts)")
    if not os.path.isabs(run_dir):
        raise ConfigError(f"--run_dir {run_dir}: with --shared_fs give the absolute path every host mounts")


def check_batch(train_args: tuple[str, ...], num_slices: int):
    """The training flags parse (a bad one is said here, not on 64 hosts), and the slices share the batch."""
    import configs
    from configs.base import Config
    from configs.cli import parse

    argv, name = list(train_args), configs.DEFAULT
    for i, a in enumerate(argv):
        if a.startswith("--config"):
            name = a.split("=", 1)[1] if "=" in a else argv[i + 1]
            del argv[i: i + (1 if "=" in a else 2)]
            break
    cfg = parse(Config, argv, default=configs.load(name), prog="train.py")
    if cfg.mesh.num_slices not in (1, num_slices):
        raise ConfigError(f"--mesh.num_slices={cfg.mesh.num_slices} after -- but --num_slices {num_slices}: give"
                          " --num_slices to the launcher (it passes --mesh.num_slices on)")
    if cfg.train.batch_size % num_slices:
        raise ConfigError(f"--num_slices {num_slices} does not divide train.batch_size {cfg.train.batch_size}:"
                          " each slice takes an equal share of the batch")
    return cfg


def git(*args: str) -> str:
    r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False)
    return r.stdout.strip() if r.returncode == 0 else ""


def head_commit() -> str:
    commit = git("rev-parse", "HEAD")
    if not commit:
        raise ConfigError(f"{ROOT} is not a git checkout: give --commit and --repo")
    if git("status", "--porcelain", "--untracked-files=no"):  # the hosts clone; local edits stay here
        warn(f"{ROOT} has uncommitted changes: the hosts install {commit[:12]} without them")
    return commit


def origin() -> str:
    """This checkout's origin as the hosts can fetch it: https for an ssh remote (they have no key for it)."""
    url = git("remote", "get-url", "origin")
    if not url:
        raise ConfigError(f"{ROOT} has no `origin` remote: give --repo (a URL every host can git clone)")
    if hosts_url(url) != url:
        print(f"note: the hosts clone {hosts_url(url)} (origin is {url}: they have no ssh key; --repo to choose)",
              file=sys.stderr, flush=True)
    return hosts_url(url)


def print_plan(job: Job) -> None:
    """--dry_run: everything the launch would run, in order, and the files it would write."""
    from tools.pod.targets import delete_commands, job_state_command, state_command

    p = plan(job)
    slices = f" x {job.num_slices} slices" if job.num_slices > 1 else ""
    print(f"# {job.slice.describe()}{slices}; {job.hosts} host(s) run train.py; hosts install {job.commit[:12]}")
    print("# before anything is created, each a one-line refusal:")
    for check in checks(job):
        print(f"#   {check}" if check[0] == "(" else f"#   $ {check}")
    print(f"# then, unless --skip_aot: python plan.py --topology {job.aot_topology} ...   (does it fit?)"
          if job.slice.is_tpu else "# no AOT check: it compiles for TPU topologies only")
    print(f"# {job.describe_hosts()}")
    for name, text in p.files.items():
        print(f"# file {job.workdir / name}:\n{text}", end="")
    for command in (*p.create, *p.install, *p.start):
        print(f"$ {command}")
    print(f"# a failed host: {p.on_failure}")
    print(f"# then every {job.poll_seconds:g} s: $ {state_command(job.where)}")
    if job.where.target == "tpu-vm":
        print(f"#   and while it is ACTIVE: $ {job_state_command(job)}")
    owner = (f"relaunched by this launcher up to {job.retries} times" if p.relaunches else
             f"restarted by JobSet up to {job.retries} times (failurePolicy.maxRestarts)")
    print(f"# a preempted slice, a saved preemption (exit 42) or a failed training is {owner}" + (
        f"; before a restart on the same hosts: $ {p.stop[0]}" if p.stop else ""))
    print(f"# delete: $ {' && '.join(delete_commands(job.where))}")
