"""A slice's shape from its Cloud TPU name (`v5e-256`, `v4-32`) or a GPU count for Slurm (`gpu-16`).

Cloud TPU names count TensorCores on v4 and v5p (two per chip) and chips on v5e and v6e. A host holds 4 chips,
except the single-host v5e-8 / v6e-8 machines, which hold 8 (Cloud TPU docs, "TPU v5e" and "TPU v6e" pages:
v5litepod-8 is one ct5lp-hightpu-8t VM, v5litepod-16 and up are ct5lp-hightpu-4t VMs of 4 chips).
"""

from __future__ import annotations

import dataclasses
import math
import re

from errors import ConfigError

# generation -> (gcloud's accelerator-type prefix, cores per chip in the name, GKE accelerator label)
TPU_GENERATIONS = {
    "v4": ("v4", 2, "tpu-v4-podslice"),
    "v5p": ("v5p", 2, "tpu-v5p-slice"),
    "v5e": ("v5litepod", 1, "tpu-v5-lite-podslice"),
    "v6e": ("v6e", 1, "tpu-v6e-slice"),
}
CHIPS_PER_HOST = 4
SINGLE_HOST_CHIPS = {"v5e": (1, 4, 8), "v6e": (1, 4, 8), "v4": (4,), "v5p": (4,)}


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
        """gcloud's --accelerator-type (v5e-256 is v5litepod-256)."""
        prefix, cores, _ = TPU_GENERATIONS[self.generation]
        return f"{prefix}-{self.chips * cores}"

    @property
    def gke_accelerator(self) -> str:
        return TPU_GENERATIONS[self.generation][2]

    @property
    def shape(self) -> str:
        """The chips' physical layout, as GKE's tpu-topology label and `plan.py --topology` write it (v5e-256: 16x16,
        v4-32: 2x2x4)."""
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


def parse_topology(name: str, gpus_per_node: int = 8) -> Slice:
    """A Slice from `v5e-256`, `v4-32` or `gpu-16`; a name that is none of these is a one-line error."""
    m = re.fullmatch(r"(v4|v5p|v5e|v6e|gpu)-(\d+)", name)
    if not m:
        raise ConfigError(f"--topology {name}: unknown; expected a Cloud TPU slice such as v5e-256, v4-32, v5p-64,"
                          " v6e-16, or gpu-N for Slurm (N GPUs)")
    generation, count = m.group(1), int(m.group(2))
    if generation == "gpu":
        if count % gpus_per_node and count > gpus_per_node or count < 1:
            raise ConfigError(f"--topology {name}: {count} GPUs is not a whole number of {gpus_per_node}-GPU nodes"
                              " (--gpus_per_node)")
        per_node = min(count, gpus_per_node)
        return Slice(name, "gpu", count, count // per_node, per_node)
    cores = TPU_GENERATIONS[generation][1]
    chips = count // cores
    if count % cores or chips < 1 or chips & (chips - 1):
        unit = "TensorCores (2 per chip)" if cores == 2 else "chips"
        raise ConfigError(f"--topology {name}: a {generation} slice counts {unit} in its name, a power of two"
                          f" of at least {cores}")
    if chips in SINGLE_HOST_CHIPS[generation]:
        return Slice(name, generation, chips, 1, chips)
    if chips < CHIPS_PER_HOST:
        raise ConfigError(f"--topology {name}: no such {generation} slice; the smallest are"
                          f" {generation}-{SINGLE_HOST_CHIPS[generation][0] * cores}")
    return Slice(name, generation, chips, chips // CHIPS_PER_HOST, CHIPS_PER_HOST)
