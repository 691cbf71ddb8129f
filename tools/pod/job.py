"""What a pod launch is (`Job`), and the commands every host runs: the install pinned to one commit, and train.py,
which finds its place in the JAX job itself (`jax.distributed.initialize()`'s cluster detection: the TPU VM's
metadata server, GKE's TPU_WORKER_* and MEGASCALE_* variables, Slurm's SLURM_* variables)."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

from tools.pod.topology import Slice

CHECKOUT = "gpt2-nnx"  # the directory each host clones into (its home on a TPU VM, the submit dir on Slurm)
# Cloud TPU runtime images ("TPU software versions" page): the base image of each generation
RUNTIME_VERSIONS = {"v4": "tpu-ubuntu2204-base", "v5p": "v2-alpha-tpuv5", "v5e": "v2-alpha-tpuv5-lite",
                    "v6e": "v2-alpha-tpuv6e"}


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
    image: str = "python:3.11"  # xpk / jobset: a container image with python3 and git
    runtime_version: str = ""  # tpu-vm: the VM image (default: RUNTIME_VERSIONS)
    spot: bool = False
    retries: int = 0
    poll_seconds: float = 60.0

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
        """Clones the repository at `commit` and installs it into a virtual environment: every host runs the
        same code as the launcher's checkout, whatever was pushed since."""
        cuda = " 'jax[cuda12]==0.10.2'" if self.slice.generation == "gpu" else ""
        return (f"set -e; [ -d {CHECKOUT} ] || git clone -q {shlex.quote(self.repo)} {CHECKOUT}; cd {CHECKOUT};"
                f" git fetch -q origin; git checkout -q {self.commit}; python3 -m venv .venv;"
                f" .venv/bin/pip install -q -e '.[{self.extras}]'{cuda}")

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
        """The training in the foreground: what a container or a Slurm task runs."""
        return f"cd {CHECKOUT} && {self.train_argv()}"

    def start_command(self) -> str:
        """Install, then train: a container's command."""
        return f"({self.install_command()}) && {self.train_command()}"
