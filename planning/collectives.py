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

# Each hop over an ICI link costs about 1 µs whatever it carries: "Each hop over an ICI link has some intrinsic
# overhead regardless of the data volume. This is typically around 1us" (jax-ml/scaling-book@0819a7d sharding.md,
# "A note on ICI latency"; inference.md: below that a collective is bound by "the fixed overhead of actually
# dispatching the collective"). A bidirectional ring of n chips passes each shard ⌊n/2⌋ hops, so a collective takes
# max(its bytes over the ring's bandwidth, hops × ICI_HOP_S) — the book's T = max(T_min, V/W) per hop — with the
# hops counted on the torus its chips occupy (planning/hlo.py's torus_extents). The same page gives a group
# spanning several torus dimensions their combined bandwidth ("increases the available bandwidth by a factor of
# n_axes"); charged so, the back-test's runs moved away from their measurements (maxtext_16b_v5e and maxtext_22b_v4
# to 1.22× measured / predicted; summed squared log error 1.66 against 1.15), so one ring's bandwidth it is.
ICI_HOP_S = 1e-6
# One step of a transfer between slices: a send handed to the host's DCN runtime (Cloud TPU "Profiling Multislice
# environments": send interrupts the host to start a DMA) and received by another host. Google publishes no figure
# for it; this is half of "round trip within same datacenter: 500,000 ns" (J. Dean, "Numbers everyone should know",
# LADIS 2009), which E. Jones measured still holding at about the 80th percentile between Google Cloud VMs of one
# zone in 2021 (evan-jones.appspot.com/network-latencies-2021.html). An assumption, not a TPU measurement: a ring
# across s slices pays it at each of its 2 (s-1) steps for an all-reduce, (s-1) otherwise (the α of Thakur,
# Rabenseifner and Gropp's α-β model, "Optimization of Collective Communication Operations in MPICH", 2005).
DCN_STEP_S = 250e-6


@dataclasses.dataclass
class Collective:
    """One kind of collective over one mesh axis, summed over its executions (trip counts included).

    Time of one execution on a bidirectional ring of n chips at `Chip.ring_bytes_per_s` (B: bytes per chip of the
    full array, the all-gather's output / the reduce-scatter's input / the all-reduce's array):
      all-gather, reduce-scatter: (n-1)/n × B / ring;  all-reduce (a reduce-scatter then an all-gather):
      2 (n-1)/n × B / ring;  all-to-all: (n-1)/n × B / ring (what leaves each chip; a lower bound, as hops
      beyond the first are not charged);  collective-permute: B / one link (one hop, one direction);
    each no less than its hops × ICI_HOP_S (⌊extent/2⌋ along each torus dimension it spans; twice for an
    all-reduce, one for a permute).
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


def collective_seconds(kind: str, n: int, nbytes: float, chip: Chip, extents: list[int] | None = None,
                       latency: bool = True) -> float:
    """One execution over n chips spanning `extents` chips along the torus dimensions it uses (default: one ring of
    n): its bytes at one bidirectional ring's bandwidth, and no less than its hops × ICI_HOP_S (⌊extent/2⌋ per
    dimension; `latency=False`: bandwidth only) — twice over for an all-reduce, one hop for a permute."""
    extents = [n] if not extents else extents
    hop = ICI_HOP_S if latency else 0.0
    if kind == "collective-permute":
        return max(nbytes / chip.ici_link_bytes_per_s, hop)
    ring = max((n - 1) / n * nbytes / chip.ring_bytes_per_s, sum(e // 2 for e in extents) * hop)
    return 2 * ring if kind == "all-reduce" else ring



def dcn_kind(instr: Instr) -> str | None:
    """The collective a megascale host transfer (a `send` to the DCN runtime) performs across slices, e.g.
    "all-reduce"; None for any other op."""
    m = re.search(r'_xla_megascale_transfer_type="(\w+)"', instr.attrs)
    return m.group(1).lower().replace("_", "-") if m and instr.opcode == "send" else None


def dcn_collective(kind: str, slices: int, nbytes: float, chip: Chip, latency: bool = True) -> Collective:
    """One cross-slice transfer of `nbytes` per chip (the send's operand) among `slices` slices: a ring across the
    slices at `Chip.dcn_bytes_per_s`, every chip of a host sending at once: 2 (s-1)/s × B for an all-reduce,
    (s-1) × B for an all-gather (B: the piece each chip holds), (s-1)/s × B otherwise; plus DCN_STEP_S for each
    of the ring's steps."""
    steps = (slices - 1) * (2 if kind == "all-reduce" else 1)
    if kind == "all-gather":
        moved = (slices - 1) * nbytes
    else:
        moved = (slices - 1) / slices * nbytes * (2 if kind == "all-reduce" else 1)
    seconds = moved / chip.dcn_bytes_per_s + steps * DCN_STEP_S * latency
    return Collective(kind, f"DCN (data across {slices} slices)", 1, nbytes, seconds, exposed=seconds)
