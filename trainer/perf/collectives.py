"""What a collective costs one chip: its bytes over the mesh axis its device groups run along, at the ICI bandwidth
of a bidirectional ring along that axis (trainer/hardware.py's Chip figures)."""

from __future__ import annotations

import dataclasses

from trainer.hardware import Chip

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclasses.dataclass
class Collective:
    """One kind of collective over one mesh axis, summed over its executions (trip counts included).

    Time of one execution on a bidirectional ring of n chips at `Chip.ring_bytes_per_s` (B: bytes per chip of the
    full array, the all-gather's output / the reduce-scatter's input / the all-reduce's array):
      all-gather, reduce-scatter: (n-1)/n × B / ring;  all-reduce (a reduce-scatter then an all-gather):
      2 (n-1)/n × B / ring;  all-to-all: (n-1)/n × B / ring (what leaves each chip; a lower bound, as hops
      beyond the first are not charged);  collective-permute: B / one link (one hop, one direction).
    """

    kind: str
    axis: str  # the mesh axes the replica groups vary over, e.g. "data" or "data+fsdp"
    count: float = 0
    bytes: float = 0  # per chip, all executions
    seconds: float = 0
    exposed: float = 0  # the part of `seconds` no op scheduled beside it hides (all of it for a synchronous one)

    def row(self) -> str:
        return (f"{self.kind} over {self.axis}: {self.count:g}×, {self.bytes / 2**20:.1f} MiB,"
                f" {self.seconds * 1e3:.2f} ms: {(self.seconds - self.exposed) * 1e3:.2f} hidden,"
                f" {self.exposed * 1e3:.2f} exposed")


def collective_seconds(kind: str, n: int, nbytes: float, chip: Chip) -> float:
    if kind == "collective-permute":
        return nbytes / chip.ici_link_bytes_per_s
    ring = (n - 1) / n * nbytes / chip.ring_bytes_per_s
    return 2 * ring if kind == "all-reduce" else ring

