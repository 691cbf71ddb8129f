"""A slice's shape from its Cloud TPU name (`v5e-256`, `v4-32`) or a GPU count for Slurm (`gpu-16`), as the chosen
target builds it.

Cloud TPU names count TensorCores on v4 and v5p (two per chip) and chips on v5e and v6e. How many hosts (VMs, one
JAX process each) a slice has depends on who builds it; each target's own table (sources: docs/pods.md):
- tpu-vm, Cloud TPU's accelerator types (the "TPU v5e" / "TPU v6e" / "TPU v4" / "TPU v5p" pages): a v5e or v6e
  slice of 1, 4 or 8 chips is one VM holding them all (v5litepod-8 is one ct5lp-hightpu-8t); larger ones are VMs
  of 4 chips. v4-8 and v5p-8 are one VM of 4 chips; larger ones VMs of 4.
- xpk, its `system_characteristics.py`: every VM holds 4 chips but a 1x1 slice's; v5e starts at 2x4
  (v5litepod-8, built on 2 VMs of 4: no v5litepod-1 or -4); v6e has 1x1 and 2x2 on one VM, 2x4 on two.
- jobset, GKE's TPU node pools: the multi-host pools xpk creates (so v5e-8 and v6e-8 are 2 hosts of 4: the
  manifest asks each pod for one node's chips), plus the single-host 1x1 and 2x2 pools of v5e and v6e.
A name the target has no slice for is refused in one line, before anything is created.
"""

from __future__ import annotations

import dataclasses
import math
import re

from errors import ConfigError

# generation -> (gcloud's accelerator-type prefix, cores per chip in the name, GKE accelerator label, most chips)
TPU_GENERATIONS = {
    "v4": ("v4", 2, "tpu-v4-podslice", 4096),  # xpk: at most 64 cubes of 4x4x4
    "v5p": ("v5p", 2, "tpu-v5p-slice", 8192),  # xpk: 140 cubes (8,960 chips); the largest power of two
    "v5e": ("v5litepod", 1, "tpu-v5-lite-podslice", 256),
    "v6e": ("v6e", 1, "tpu-v6e-slice", 256),
}
CHIPS_PER_HOST = 4  # a multi-host slice's VMs, on every target
# target -> generation -> the chip counts one host holds whole; the smallest multi-host slice is the next power of 2
SINGLE_HOST = {
    "tpu-vm": {"v4": (4,), "v5p": (4,), "v5e": (1, 4, 8), "v6e": (1, 4, 8)},
    "xpk": {"v4": (4,), "v5p": (4,), "v5e": (), "v6e": (1, 4)},
    "jobset": {"v4": (4,), "v5p": (4,), "v5e": (1, 4), "v6e": (1, 4)},
}
SMALLEST = {"xpk": {"v5e": 8}}  # below it the target has no slice at all (xpk's v5e table starts at 2x4)
TARGET_TABLES = {"tpu-vm": "Cloud TPU's accelerator types", "xpk": "xpk's system_characteristics.py",
                 "jobset": "GKE's TPU node pools"}


@dataclasses.dataclass(frozen=True)
class Slice:
    name: str  # as given: v5e-256, gpu-16
    generation: str  # v4, v5p, v5e, v6e; "gpu" for Slurm
    chips: int
    hosts: int
    chips_per_host: int

    @property
    def is_tpu(self) -> bool:
        return self.generation != "gpu"

    @property
    def accelerator_type(self) -> str:
        """gcloud's --accelerator-type and xpk's --tpu-type (v5e-256 is v5litepod-256)."""
        prefix, cores, _, _ = TPU_GENERATIONS[self.generation]
        return f"{prefix}-{self.chips * cores}"

    @property
    def gke_accelerator(self) -> str:
        return TPU_GENERATIONS[self.generation][2]

    @property
    def shape(self) -> str:
        """The chips' physical layout, as GKE's tpu-topology label and `plan.py --topology` write it (v5e-256:
        16x16, v4-32: 2x2x4); for these power-of-two sizes it is xpk's default topology of the name."""
        dims = [1, 1, 1] if self.generation in ("v4", "v5p") else [1, 1]
        for i in range(int(math.log2(self.chips))):  # powers of two: double the dimensions in turn
            dims[i % len(dims)] *= 2
        dims = sorted(d for d in dims if d > 1) + [d for d in dims if d == 1]  # v4-8: 2x2x1, as GKE writes it
        return "x".join(str(d) for d in dims)

    @property
    def aot_topology(self) -> str:
        """planning.aot's topology name (v5e:16x16)."""
        return f"{self.generation}:{self.shape}"

    def describe(self) -> str:
        unit = "GPUs" if not self.is_tpu else "chips"
        return (f"{self.name}: {self.chips} {unit}, {self.hosts} host{'s' if self.hosts > 1 else ''} of"
                f" {self.chips_per_host}")


def parse_topology(name: str, target: str = "tpu-vm", gpus_per_node: int = 8) -> Slice:
    """A Slice from `v5e-256`, `v4-32` (as `target` builds it) or `gpu-16`; a name that is none of these, or a
    slice the target does not have, is a one-line error."""
    m = re.fullmatch(r"(v4|v5p|v5e|v6e|gpu)-(\d+)", name)
    if not m:
        raise ConfigError(f"--topology {name}: unknown; expected a Cloud TPU slice such as v5e-256, v4-32, v5p-64,"
                          " v6e-16, or gpu-N for Slurm (N GPUs)")
    generation, count = m.group(1), int(m.group(2))
    if (generation == "gpu") != (target == "slurm"):
        raise ConfigError(f"--topology {name} with --target {target}: slurm runs gpu-N topologies, the other"
                          " targets Cloud TPU slices")
    if generation == "gpu":
        return _gpu_nodes(name, count, gpus_per_node)
    _, cores, _, most = TPU_GENERATIONS[generation]
    chips = count // cores
    if count % cores or chips < 1 or chips & (chips - 1) or chips > most:
        unit = "TensorCores (2 per chip)" if cores == 2 else "chips"
        raise ConfigError(f"--topology {name}: a {generation} slice counts {unit} in its name, a power of two"
                          f" from {cores} to {most * cores}")
    single = SINGLE_HOST[target][generation]
    smallest = SMALLEST.get(target, {}).get(generation, min(single, default=CHIPS_PER_HOST * 2))
    if chips < smallest or chips < CHIPS_PER_HOST * 2 and chips not in single:
        sizes = sorted({*single, *(c for c in (8, 16) if c >= smallest and c not in single)})
        known = ", ".join(f"{generation}-{c * cores}" for c in sizes)
        raise ConfigError(f"--topology {name}: {TARGET_TABLES[target]} have no such {generation} slice (--target"
                          f" {target}); its smallest are {known}")
    if chips in single:
        return Slice(name, generation, chips, 1, chips)
    return Slice(name, generation, chips, chips // CHIPS_PER_HOST, CHIPS_PER_HOST)


def _gpu_nodes(name: str, count: int, gpus_per_node: int) -> Slice:
    if gpus_per_node < 1 or count < 1 or count % gpus_per_node and count > gpus_per_node:
        raise ConfigError(f"--topology {name}: {count} GPUs is not a whole number of {gpus_per_node}-GPU nodes"
                          " (--gpus_per_node)")
    per_node = min(count, gpus_per_node)
    return Slice(name, "gpu", count, count // per_node, per_node)
