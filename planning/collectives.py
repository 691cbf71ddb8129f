"""What a collective costs one chip: its bytes over the mesh axis its device groups run along, at the ICI bandwidth
of a bidirectional ring along that axis, or, between the slices of a multislice program, at the chip's share of its
host's data-center network (DCN) bandwidth (planning/chips.py).

libtpu compiles a multislice program as one slice's program: the replica groups of its collectives never leave the
slice, and each reduction across slices is a `send` / `recv` pair handed to the host's DCN runtime ("megascale"),
tagged `_xla_megascale_transfer_type="ALL_REDUCE"`, whose operand is what each chip contributes once the collectives
inside the slice have reduced it (e.g. a reduce-scatter over the slice's `data` first).
"""

from __future__ import annotations

import dataclasses
import re

from planning.chips import Chip
from planning.hlo import Instr

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

    @property
    def over_dcn(self) -> bool:
        return self.axis.startswith("DCN")

    def row(self) -> str:
        return (f"{self.kind} over {self.axis}: {self.count:g}×, {self.bytes / 2**20:.1f} MiB,"
                f" {self.seconds * 1e3:.2f} ms: {(self.seconds - self.exposed) * 1e3:.2f} hidden,"
                f" {self.exposed * 1e3:.2f} exposed")


def collective_seconds(kind: str, n: int, nbytes: float, chip: Chip) -> float:
    if kind == "collective-permute":
        return nbytes / chip.ici_link_bytes_per_s
    ring = (n - 1) / n * nbytes / chip.ring_bytes_per_s
    return 2 * ring if kind == "all-reduce" else ring



def dcn_kind(instr: Instr) -> str | None:
    """The collective a megascale host transfer (a `send` to the DCN runtime) performs across slices, e.g.
    "all-reduce"; None for any other op."""
    m = re.search(r'_xla_megascale_transfer_type="(\w+)"', instr.attrs)
    return m.group(1).lower().replace("_", "-") if m and instr.opcode == "send" else None


def dcn_collective(kind: str, slices: int, nbytes: float, chip: Chip) -> Collective:
    """One cross-slice transfer of `nbytes` per chip (the send's operand) among `slices` slices: a ring across the
    slices at `Chip.dcn_bytes_per_s`, every chip of a host sending at once: 2 (s-1)/s × B for an all-reduce,
    (s-1) × B for an all-gather (B: the piece each chip holds), (s-1)/s × B otherwise."""
    if kind == "all-gather":
        moved = (slices - 1) * nbytes
    else:
        moved = (slices - 1) / slices * nbytes * (2 if kind == "all-reduce" else 1)
    seconds = moved / chip.dcn_bytes_per_s
    return Collective(kind, f"DCN (data across {slices} slices)", 1, nbytes, seconds, exposed=seconds)
