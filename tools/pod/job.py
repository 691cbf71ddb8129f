"""What a pod launch is (`Job`), and the commands every host runs: the install pinned to one commit, into a
Python the project supports whatever the image's python3 is, and train.py, which finds its place in the JAX job
itself (`jax.distributed.initialize()`'s cluster detection: the TPU VM's metadata server, GKE's TPU_WORKER_* and
MEGASCALE_* variables, Slurm's SLURM_* variables), run through `tools.pod.host train` so that a saved preemption
ends it with the status every target restarts on."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

from tools.pod.topology import Slice

CHECKOUT = "gpt2-nnx"  # the directory each host clones into (its home on a TPU VM, the submit dir on Slurm)
# Cloud TPU runtime images ("TPU software versions" page): the base image of each generation
RUNTIME_VERSIONS = {"v4": "tpu-ubuntu2204-base", "v5p": "v2-alpha-tpuv5", "v5e": "v2-alpha-tpuv5-lite",
                    "v6e": "v2-alpha-tpuv6e"}
# The hosts' Python: uv's own build of it (python-build-standalone), never the image's python3. The TPU VM images
# are Ubuntu 22.04, whose python3 is 3.10 and may lack its venv module; pyproject.toml and JAX 0.10.2 need >= 3.11.
PYTHON = "3.11"
UV = "0.12.5"  # pinned: the same installer on every host, every relaunch
UV_BIN = '"$HOME/.local/bin/uv"'  # where both of its installers put it (pip --user's scripts, UV_INSTALL_DIR)


@dataclasses.dataclass(frozen=True)
class Where:
    """Where a job's resources live: all that `delete` and `status` need."""

    target: str  # tpu-vm, xpk, jobset, slurm
    name: str
    zone: str = ""
    project: str = ""
    cluster: str = ""  # xpk / jobset: the GKE cluster
    workdir: Path = Path(".")  # the launcher's files for this job (slurm: the submitted job's id)


@dataclasses.dataclass(frozen=True)
class Job:
    where: Where
    slice: Slice
    num_slices: int
    run_dir: str
    repo: str  # what hosts `git clone`
    commit: str  # the commit they check out: this checkout's HEAD unless --commit
    train_args: tuple[str, ...]  # train.py's flags (without --run_dir)
    image: str = "python:3.11"  # xpk / jobset: a container image with git and python3 (or curl)
    runtime_version: str = ""  # tpu-vm: the VM image (default: RUNTIME_VERSIONS)
    spot: bool = False
    retries: int = 0
    poll_seconds: float = 60.0
    cluster_location: str = ""  # xpk / jobset: the cluster's region or zone (preflight.cluster_location)
    tries: int = 3  # a failed step on the hosts (the install, the start) is run this many times in all
    backoff_seconds: float = 10.0  # before the second try; doubled before each next
    blind_seconds: float = 3600.0  # the job's state unreadable this long ends the launcher
    delete_on_failure: bool = False  # a launch that fails deletes what it created (else prints the command)

    @property
    def name(self) -> str:
        return self.where.name

    @property
    def workdir(self) -> Path:
        return self.where.workdir

    @property
    def hosts(self) -> int:
        return self.slice.hosts * self.num_slices

    @property
    def extras(self) -> str:
        return "gcs" if self.slice.generation == "gpu" else "tpu,gcs"

    def install_command(self) -> str:
        """Clones the repository at `commit` and installs it into .venv on uv's Python: every host runs the same
        code as the launcher's checkout, whatever was pushed since, on the same interpreter, whatever its image.
        Each part may run again (a retried install, a relaunch on the same hosts)."""
        return "; ".join(("set -e", *self._checkout(), *_uv(), *self._venv()))

    def _checkout(self) -> tuple[str, ...]:
        return (f"[ -d {CHECKOUT} ] || git clone -q {shlex.quote(self.repo)} {CHECKOUT}", f"cd {CHECKOUT}",
                "git fetch -q origin", f"git checkout -q {self.commit}")

    def _venv(self) -> tuple[str, ...]:
        """uv's Python inside the checkout (`.python`: on Slurm the submit directory every node mounts, where a
        home directory may not be), then the project into .venv."""
        cuda = " 'jax[cuda12]==0.10.2'" if self.slice.generation == "gpu" else ""
        return ('export UV_PYTHON_INSTALL_DIR="$PWD/.python"',
                f"{UV_BIN} venv -q --allow-existing --python {PYTHON} .venv",
                f"{UV_BIN} pip install -q --python .venv/bin/python -e '.[{self.extras}]'{cuda}")

    @property
    def aot_topology(self) -> str:
        """What `plan.py --topology` compiles for: one slice's topology, `*N` for N slices."""
        return self.slice.aot_topology + (f"*{self.num_slices}" if self.num_slices > 1 else "")

    def train_argv(self) -> str:
        """train.py and its flags, quoted; several slices: the mesh's `data` axis spans them (--mesh.num_slices)."""
        slices = (f"--mesh.num_slices={self.num_slices}",) if self.num_slices > 1 and not any(
            a.startswith("--mesh.num_slices") for a in self.train_args) else ()
        args = " ".join(shlex.quote(a) for a in (*self.train_args, *slices, f"--run_dir={self.run_dir}"))
        return f".venv/bin/python train.py {args}"

    def train_command(self) -> str:
        """The training in the foreground (a container's or a Slurm task's), its saved preemption's exit 0 turned
        into the status the target restarts on (tools/pod/host.py). `exec`: the shell's signals reach it, which
        passes them on to train.py: xpk's container sends SIGTERM to its command's process only
        (docker_container.py), and a container's PID 1 (bash, without it) ignores SIGTERM."""
        return (f"cd {CHECKOUT} && exec .venv/bin/python -m tools.pod.host train"
                f" --run_dir={shlex.quote(self.run_dir)} -- {self.train_argv()}")

    def start_command(self) -> str:
        """Install, then train: a container's command."""
        return f"({self.install_command()}) && {self.train_command()}"

    def describe_hosts(self) -> str:
        """--dry_run: what each host runs, on which Python."""
        who = ("the batch script, once into the submit directory every node mounts," if self.where.target == "slurm"
               else "each host")
        return (f"{who} clones {self.repo} at {self.commit[:12]}, installs uv {UV} (pip install --user, else its"
                f" installer script) and uv's own Python {PYTHON} (not the image's python3), then '.[{self.extras}]'"
                " into .venv; every host runs train.py on it")


def _uv() -> tuple[str, ...]:
    """uv, from PyPI with any python3 that has pip (Ubuntu's 3.10 does, user site), else from its installer
    script (curl; e.g. an image without pip); neither needs the image's venv module."""
    return (f"[ -x {UV_BIN} ] || python3 -m pip install -q --user uv=={UV} || curl -LsSf"
            f" https://astral.sh/uv/{UV}/install.sh | env UV_INSTALL_DIR=\"$HOME/.local/bin\" UV_NO_MODIFY_PATH=1 sh",)
