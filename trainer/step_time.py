"""A step-time estimate of a compiled TPU program, read from its optimized HLO: each op at libtpu's cost model's rates
plus the ICI collectives that the schedule leaves exposed.

libtpu's own cost model (`compiled.cost_analysis()["optimal_seconds"]`) gives up on our train call (it returns a
negative number), and XLA's flop count covers a loop body once. This module walks the compiled program's HLO text
(`compiled.as_text()`, the module libtpu scheduled) instead, costing each op as libtpu's model costs it on its own
(trainer/op_cost.py; benchmarks/calibrate_step_time.py checks the two agree):

- compute: the MXU's FLOPs (convolutions and dots, from their shapes) and the transcendentals (exp, tanh, rsqrt, ...
  one per element), each at libtpu's rate for the chip; splash attention's Pallas kernels from their block shapes;
- HBM: the bytes each op the TensorCore runs (a fusion, a copy, an async prefetch) reads from and writes to HBM, at
  their stored size (tile padding included), at libtpu's HBM rate; arrays the compiler placed in VMEM (layout
  memory space S(1)) or SMEM cost nothing;
- while loops (scans over layers, the K-step scan, gradient accumulation) multiply their body by the trip count;
  a conditional costs its most expensive branch (the train call's "active" branch is the whole step);
- each collective's time comes from its bytes and the mesh axis its replica groups run over, at the ICI bandwidth
  of a bidirectional ring along that axis (`Collective`). An async one is hidden by the ops scheduled between its
  start and its done (the text's order is the schedule); the rest of it, and all of a synchronous one, is exposed.

The predicted step is the ops in series plus the exposed collectives, and no less than the HBM traffic (async
prefetches are DMAs beside the compute). Everything here is a prediction from the compiled program, not a
measurement.

`estimate(compiled, chip, mesh)` is the entry point (trainer/aot.py's report; a planner ranking candidate
configurations by `StepTimeEstimate.row()`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from functools import cached_property

import numpy as np

from trainer import op_cost
from trainer.metrics import PEAK_FLOPS


@dataclasses.dataclass(frozen=True)
class Chip:
    """A TPU generation's published figures (per chip)."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes: int
    hbm_bytes_per_s: float
    ici_link_bytes_per_s: float  # one ICI link, one direction
    host: tuple[int, int, int]  # chips per host, for jax.experimental.topologies
    # libtpu's chip configuration: "megacore" makes a chip of two TensorCores (v4, v5p) one JAX device, as JAX
    # requires for meshes on those chips (and as a v4-8's 4 chips run); "default" gives one device per core
    chip_config: str = "default"

    @property
    def ring_bytes_per_s(self) -> float:
        # a bidirectional ring along one mesh axis sends on two links at once (both directions of one torus dimension)
        return 2 * self.ici_link_bytes_per_s


# Cloud TPU documentation, "TPU v4" / "TPU v5e" / "TPU v5p" / "TPU v6e" pages (cloud.google.com/tpu/docs/v4, .../v5e,
# .../v5p, .../v6e): HBM capacity and bandwidth per chip; bidirectional ICI bandwidth per chip over its ports
# (v5e 400 GBps / 4 ports, v5p 1200 GBps / 6 ports, v6e 800 GBps / 4 ports -> 50, 100, 100 GB/s per port and
# direction). The v4 page gives no ICI figure: 6 links of 400 Gbit/s (50 GB/s) per direction is from the TPU v4
# paper (Jouppi et al., "TPU v4: An Optically Reconfigurable Supercomputer...", ISCA 2023, arXiv:2304.01433).
# Peak bf16 FLOP/s: trainer/metrics.py's PEAK_FLOPS (the same pages).
# HBM sizes stay in GiB as the AOT report has always compared them (the compiler reports 15.75 GiB usable on v5e).
CHIPS = {
    "v4": Chip("v4", PEAK_FLOPS["TPU v4"], 32 * 2**30, 1200e9, 50e9, (2, 2, 1), "megacore"),
    "v5e": Chip("v5e", PEAK_FLOPS["TPU v5e"], 16 * 2**30, 819e9, 50e9, (2, 2, 1)),
    "v5p": Chip("v5p", PEAK_FLOPS["TPU v5p"], 95 * 2**30, 2765e9, 100e9, (2, 2, 1), "megacore"),
    "v6e": Chip("v6e", PEAK_FLOPS["TPU v6e"], 32 * 2**30, 1638e9, 100e9, (2, 2, 1)),
}

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


# ---------------------------------------------------------------------------------------------- the HLO text

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\](?:\{([^}]*)\})?")
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+) \(.*\{$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+) = (.*)$", re.DOTALL)  # DOTALL: a kernel's config spans lines


@dataclasses.dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]
    memory_space: int  # 0 HBM; 1 VMEM; others are sync flags / SMEM
    elements: int  # as stored: the layout's tile pads the minor dimensions (op_cost.stored_elements)

    @property
    def bytes(self) -> float:
        return self.elements * DTYPE_BYTES.get(self.dtype, 4)


def _arrays(shape: str) -> tuple[Array, ...]:
    """Every array in a (possibly nested tuple) shape, flattened in order."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(shape):
        space = re.search(r"S\((\d+)\)", layout or "")
        dims = tuple(int(d) for d in dims.split(",") if d)
        out.append(Array(dtype, dims, int(space.group(1)) if space else 0, op_cost.stored_elements(dims, layout)))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Instr:
    name: str
    opcode: str
    arrays: tuple[Array, ...]  # the result (a tuple's elements flattened)
    operands: tuple[str, ...]  # operand names; for a constant, its literal
    attrs: str  # everything after the operands, metadata removed
    is_root: bool

    @property
    def bytes(self) -> float:
        return sum(a.bytes for a in self.arrays)

    @property
    def hbm_bytes(self) -> float:
        return sum(a.bytes for a in self.arrays if a.memory_space == 0)

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=(%[\w.\-]+|\{{[^}}]*\}}|[^,\s]+)", self.attrs)
        return m.group(1) if m else None


def _matching(text: str, start: int) -> int:
    """Index of the bracket closing text[start]."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "({[":
            depth += 1
        elif text[i] in ")}]":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced HLO text: {text[start:start + 80]}")


def _instr(line: str) -> Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    root, name, rest = m.groups()
    end = _matching(rest, 0) + 1 if rest.startswith("(") else rest.index(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    paren = rest.index("(")
    close = _matching(rest, paren)
    listed = re.sub(r"/\*.*?\*/", "", rest[paren + 1:close])  # drop /*index=5*/ markers
    operands = tuple(o.strip().lstrip("%") for o in listed.split(",") if o.strip())
    attrs = re.sub(r"metadata=\{[^}]*\}", "", rest[close + 1:])
    return Instr(name, rest[:paren], _arrays(shape), operands, attrs, bool(root))


@dataclasses.dataclass
class Computation:
    name: str
    instrs: dict[str, Instr]  # in program order

    @cached_property
    def root(self) -> Instr:
        return next(i for i in self.instrs.values() if i.is_root)

    @cached_property
    def users(self) -> dict[str, list[Instr]]:
        users = defaultdict(list)
        for i in self.instrs.values():
            for o in i.operands:
                users[o].append(i)
        return users

    def parameter(self, index: int) -> Instr:
        return next(i for i in self.instrs.values() if i.opcode == "parameter" and i.operands == (str(index),))


def parse_hlo(text: str) -> tuple[dict[str, Computation], str]:
    """The computations of an HLO module's text, and the entry computation's name."""
    comps, entry, current = {}, None, None
    for line in _logical_lines(text):
        header = _HEADER.match(line)
        if header:
            current = Computation(header.group(2), {})
            comps[current.name] = current
            entry = current.name if header.group(1) else entry
        elif line == "}":
            current = None
        elif current is not None and (instr := _instr(line)):
            current.instrs[instr.name] = instr
    return comps, entry


def _logical_lines(text: str) -> list[str]:
    """The text's lines, with an instruction's continuation lines (a Mosaic kernel's backend_config spans
    several) joined to it."""
    lines = []
    for line in text.splitlines():
        starts = line == "}" or line.startswith(("  %", "  ROOT ", "%", "ENTRY ")) or not line.strip()
        if starts or not lines:
            lines.append(line)
        else:
            lines[-1] += "\n" + line
    return lines


# ---------------------------------------------------------------------------------------------- FLOPs

def _labels(instr: Instr) -> tuple[str, str, str]:
    lhs, rest = instr.attr("dim_labels").split("_")
    rhs, out = rest.split("->")
    return lhs, rhs, out


def _window(instr: Instr, rank: int) -> dict[str, list]:
    """The convolution window's per-spatial-dimension fields (size, stride, pad, lhs/rhs dilation)."""
    w = {"size": [1] * rank, "stride": [1] * rank, "pad": [(0, 0)] * rank, "lhs_dilate": [1] * rank,
         "rhs_dilate": [1] * rank}
    m = re.search(r"window=\{([^}]*)\}", instr.attrs)
    for field in (m.group(1).split() if m else []):
        key, value = field.split("=")
        if key == "pad":
            w["pad"] = [tuple(int(p) for p in part.split("_")) for part in value.split("x")]
        elif key in w:
            w[key] = [int(v) for v in value.split("x")]
    return w


def _valid_taps(in_size: int, out_size: int, size: int, stride: int, pad: tuple[int, int], lhs_dilate: int,
                rhs_dilate: int) -> int:
    """(output position, window tap) pairs that land on a real input element along one spatial dimension.

    TPU HLO writes batched matmuls as convolutions with base dilation (`lhs_dilate`), where most taps land in the
    dilation holes; counting only real taps gives the matmul's true FLOPs (as XLA's own cost analysis does).
    """
    o = np.arange(out_size)[:, None]
    k = np.arange(size)[None, :]
    p = o * stride + k * rhs_dilate - pad[0]
    real = (p >= 0) & (p <= (in_size - 1) * lhs_dilate) & (p % lhs_dilate == 0)
    return int(real.sum())


def convolution_flops(instr: Instr, comp: Computation) -> float:
    """2 × output batch × output features × kernel input features × real window taps."""
    lhs_labels, rhs_labels, out_labels = _labels(instr)
    lhs, rhs, out = comp.instrs[instr.operands[0]].arrays[0], comp.instrs[instr.operands[1]].arrays[0], instr.arrays[0]
    spatial = [c for c in out_labels if c.isdigit()]
    w = _window(instr, len(spatial))
    taps = 1
    for d, c in enumerate(sorted(spatial)):
        taps *= _valid_taps(lhs.dims[lhs_labels.index(c)], out.dims[out_labels.index(c)], w["size"][d],
                            w["stride"][d], w["pad"][d], w["lhs_dilate"][d], w["rhs_dilate"][d])
    batch, features = out.dims[out_labels.index("b")], out.dims[out_labels.index("f")]
    return 2.0 * batch * features * rhs.dims[rhs_labels.index("i")] * taps


def dot_flops(instr: Instr, comp: Computation) -> float:
    """2 × output elements × contracted elements."""
    lhs = comp.instrs[instr.operands[0]].arrays[0]
    contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", instr.attrs)
    dims = [int(d) for d in contracting.group(1).split(",") if d] if contracting else []
    return 2.0 * math.prod(instr.arrays[0].dims) * math.prod(lhs.dims[d] for d in dims)


# ---------------------------------------------------------------------------------------------- collectives

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


def replica_groups(attrs: str, devices: int) -> list[list[int]]:
    """The device groups of a collective, from any of HLO's three spellings."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:  # mesh['axis_0'=8,'axis_1'=1] {'axis_0'}: an iota of device ids shaped like that mesh
        names = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        grouped = re.findall(r"'(\w+)'", m.group(2))
        ids = np.arange(devices).reshape([int(s) for _, s in names])
        axes = [i for i, (n, _) in enumerate(names) if n in grouped]
        rest = [i for i in range(len(names)) if i not in axes]
        return ids.transpose(rest + axes).reshape(-1, math.prod(ids.shape[i] for i in axes)).tolist()
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", attrs)
    if m:  # [groups, size]<=[reshape]T(perm): iota, reshaped, transposed, cut into rows
        shape, reshape = [int(x) for x in m.group(1).split(",")], [int(x) for x in m.group(2).split(",")]
        ids = np.arange(math.prod(reshape)).reshape(reshape)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(-1, shape[-1]).tolist()
    m = re.search(r"(?:replica_groups|source_target_pairs)=\{((?:\{[0-9,]*\},?)*)\}", attrs)
    groups = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([0-9,]*)\}", m.group(1))] if m else []
    return [g for g in groups if g] or [list(range(devices))]


def mesh_axis(groups: list[list[int]], mesh_shape: dict[str, int]) -> str:
    """The mesh axes along which a group's devices differ (device id i is position i of the mesh, row-major)."""
    coords = np.stack(np.unravel_index(np.asarray(groups), tuple(mesh_shape.values())), -1)  # [groups, size, axes]
    varies = (coords != coords[:, :1]).any(axis=(0, 1))
    return "+".join(name for name, v in zip(mesh_shape, varies) if v) or "none"


def collective_seconds(kind: str, n: int, nbytes: float, chip: Chip) -> float:
    if kind == "collective-permute":
        return nbytes / chip.ici_link_bytes_per_s
    ring = (n - 1) / n * nbytes / chip.ring_bytes_per_s
    return 2 * ring if kind == "all-reduce" else ring


# ---------------------------------------------------------------------------------------------- costs

# Ops that move no data: tuple plumbing, layout-only views, and the second half of an async pair (its first half is
# charged). ConcatBitcast glues async slices into one buffer by aliasing; AllocateBuffer only reserves memory.
FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id", "replica-id",
        "opt-barrier", "add-dependency", "domain"}
FREE_CUSTOM_CALLS = {"AllocateBuffer", "ConcatBitcast"}


@dataclasses.dataclass
class Cost:
    """What a computation costs one chip; seconds at a given chip's peak and bandwidths."""

    flops: float = 0.0
    hbm_bytes: float = 0.0
    compute_s: float = 0.0  # Σ FLOPs / peak
    hbm_s: float = 0.0  # Σ HBM bytes / HBM bandwidth
    roofline_s: float = 0.0  # Σ over ops of max(compute, HBM), async copies left out
    memory_bound_s: float = 0.0  # the part of roofline_s spent in ops whose HBM time exceeds their compute time
    collectives: dict[tuple[str, str], Collective] = dataclasses.field(default_factory=dict)
    opaque_kernels: float = 0  # Pallas / Mosaic kernels (tpu_custom_call), whose FLOPs the HLO does not state
    splash_kernels: float = 0  # splash attention's kernels, costed from their block shapes
    unknown_loops: int = 0  # while loops whose trip count could not be read (counted once)

    @property
    def collective_s(self) -> float:
        return sum(c.seconds for c in self.collectives.values())

    @property
    def exposed_s(self) -> float:
        return sum(c.exposed for c in self.collectives.values())

    def add(self, other: Cost, times: float = 1.0) -> None:
        for f in ("flops", "hbm_bytes", "compute_s", "hbm_s", "roofline_s", "memory_bound_s", "opaque_kernels",
                  "splash_kernels"):
            setattr(self, f, getattr(self, f) + times * getattr(other, f))
        self.unknown_loops += other.unknown_loops
        for key, c in other.collectives.items():
            mine = self.collectives.setdefault(key, Collective(*key))
            mine.count += times * c.count
            mine.bytes += times * c.bytes
            mine.seconds += times * c.seconds
            mine.exposed += times * c.exposed


class _Walker:
    """Costs of an HLO module's computations for one chip and mesh, each computed once."""

    def __init__(self, comps: dict[str, Computation], chip: Chip, mesh_shape: dict[str, int]):
        self.comps, self.chip, self.mesh_shape = comps, chip, mesh_shape
        self.devices = math.prod(mesh_shape.values())
        self.rates = op_cost.RATES[chip.name]
        self._costs: dict[str, Cost] = {}
        self._flops: dict[str, float] = {}
        self._transcendentals: dict[str, float] = {}

    def computation(self, name: str) -> Cost:
        """Its ops in schedule order (the text's order): an async collective is hidden by the time of the ops
        scheduled between its start and its done, and exposed for the rest."""
        if name not in self._costs:
            comp, cost = self.comps[name], Cost()
            started: dict[str, list] = {}  # pairing key -> [the start, op seconds scheduled since]
            for instr in comp.instrs.values():
                role, key = self.async_role(instr)
                if role == "done" and key in started:
                    start, covered = started.pop(key)
                    cost.add(_overlapped(self.async_collectives(instr, start), covered))
                op = self.op(instr, comp)
                cost.add(op)
                for pending in started.values():
                    pending[1] += op.roofline_s
                if role == "start":
                    started[key] = [instr, 0.0]
            self._costs[name] = cost
        return self._costs[name]

    def async_role(self, instr: Instr) -> tuple[str | None, str | None]:
        """("start" or "done", the key pairing them) for a half of an async collective; (None, None) else.
        Three spellings: `all-gather-start`/`-done` (and the other collectives'), `async-start`/`-done` around a
        reduce-scatter or all-to-all, and libtpu's async collective fusions, whose fused roots are the custom
        calls AsyncCollectiveStart / AsyncCollectiveDone, paired by their collective's channel."""
        code = instr.opcode
        for half in ("start", "done"):
            if code.removesuffix(f"-{half}") in COLLECTIVES and code.endswith(f"-{half}"):
                return half, instr.name if half == "start" else instr.operands[0]
        if code == "async-start" and self.computation(_called(instr, "calls")[0]).collectives:
            return "start", instr.name
        if code == "async-done":
            return "done", instr.operands[0]
        if code == "fusion":
            return self._async_fusions.get(_called(instr, "calls")[0], (None, None))
        return None, None

    def async_collectives(self, done: Instr, start: Instr) -> Cost:
        if start.opcode == "async-start":
            return self.computation(_called(start, "calls")[0])
        if start.opcode == "fusion":
            return self.fused_collectives(_called(start, "calls")[0], async_too=True)
        return self.collective(done, start, kind=start.opcode.removesuffix("-start"))

    @cached_property
    def _async_fusions(self) -> dict[str, tuple[str, str]]:
        """Fused computations that start or end an async collective -> (role, its collective's channel id)."""
        roles = {}
        for name, comp in self.comps.items():
            target = (comp.root.attr("custom_call_target") or "").strip('"')
            role = {"AsyncCollectiveStart": "start", "AsyncCollectiveDone": "done"}.get(target)
            channel = next((i.attr("channel_id") for i in comp.instrs.values() if i.opcode in COLLECTIVES), None)
            if role and channel:
                roles[name] = (role, channel)
        return roles

    @cached_property
    def _async_channels(self) -> set[str]:
        return {channel for _, channel in self._async_fusions.values()}

    def op(self, instr: Instr, comp: Computation) -> Cost:
        code = instr.opcode
        if code == "while":
            return self.loop(instr, comp)
        if code == "conditional":  # the most expensive branch: the train call's "active" one is the whole step
            return max((self.computation(b) for b in _called(instr, "branch_computations", "true_computation",
                                                              "false_computation")),
                       key=lambda c: c.roofline_s + c.exposed_s, default=Cost())
        if code == "async-start" and self.async_role(instr)[0] == "start":
            return Cost()  # its collective is charged at its done
        if code in ("call", "async-start"):
            return self.computation(_called(instr, "to_apply", "calls")[0])
        if code in COLLECTIVES:
            return self.collective(instr, instr)
        if code in FREE or code.endswith("-done") or code.removesuffix("-start") in COLLECTIVES:
            return Cost()
        if code == "custom-call" and instr.attr("custom_call_target").strip('"') in FREE_CUSTOM_CALLS:
            return Cost()
        cost = self.roofline(instr, comp)
        if code == "fusion":
            cost.add(self.fused_collectives(_called(instr, "calls")[0]))
        return cost

    def fused_collectives(self, name: str, async_too: bool = False) -> Cost:
        """Collectives libtpu fused with compute ("all-reduce-scatter": a reduce-scatter written as an
        all-reduce). An async collective fusion's collective also appears in the fusions that run beside it
        (the matmuls that consume an all-gather) and in its done: it is charged once, by `async_collectives`."""
        cost = Cost()
        for instr in self.comps[name].instrs.values():
            if instr.opcode in COLLECTIVES and (async_too or instr.attr("channel_id") not in self._async_channels):
                kind = "reduce-scatter" if name.startswith("all-reduce-scatter") else None
                cost.add(self.collective(instr, instr, kind=kind))
            elif instr.opcode == "fusion":
                cost.add(self.fused_collectives(_called(instr, "calls")[0], async_too))
        return cost

    def roofline(self, instr: Instr, comp: Computation) -> Cost:
        flops, nbytes = self.flops(instr, comp), self.hbm_bytes(instr, comp)
        kernel = instr.attr("custom_call_target") == '"tpu_custom_call"'
        work = op_cost.kernel_compute_seconds if kernel else op_cost.compute_seconds
        compute = work(self.rates, flops, self.transcendentals(instr, comp))
        memory = op_cost.memory_seconds(self.rates, nbytes)
        # an async copy (a prefetch into VMEM, an eviction) is a DMA beside the compute: it uses HBM bandwidth
        # but does not hold up the ops in series
        serial = 0.0 if instr.opcode in ASYNC_COPIES else max(compute, memory)
        return Cost(flops=flops, hbm_bytes=nbytes, compute_s=compute, hbm_s=memory, roofline_s=serial,
                    memory_bound_s=serial if memory > compute else 0.0, opaque_kernels=kernel and not flops,
                    splash_kernels=kernel and flops > 0)

    def flops(self, instr: Instr, comp: Computation) -> float:
        """MXU FLOPs: convolutions, dots and splash's kernels, in fusions too."""
        if instr.opcode == "custom-call" and instr.attr("custom_call_target") == '"tpu_custom_call"':
            return splash_work(instr, comp)[0]
        if instr.opcode == "convolution":
            return convolution_flops(instr, comp)
        if instr.opcode == "dot":
            return dot_flops(instr, comp)
        return self._fused_sum(instr, self.flops, self._flops)

    def transcendentals(self, instr: Instr, comp: Computation) -> float:
        """Elements of exp, log, tanh, rsqrt, ... results (one transcendental each), in fusions too."""
        if instr.opcode == "custom-call" and instr.attr("custom_call_target") == '"tpu_custom_call"':
            return splash_work(instr, comp)[1]
        if instr.opcode in op_cost.TRANSCENDENTAL:
            return sum(math.prod(a.dims) for a in instr.arrays)
        return self._fused_sum(instr, self.transcendentals, self._transcendentals)

    def _fused_sum(self, instr: Instr, count, cache: dict[str, float]) -> float:
        """`count` summed over a fusion's instructions, once per fused computation."""
        if instr.opcode != "fusion":
            return 0.0
        name = _called(instr, "calls")[0]
        if name not in cache:
            fused = self.comps[name]
            cache[name] = sum(count(i, fused) for i in fused.instrs.values())
        return cache[name]

    def hbm_bytes(self, instr: Instr, comp: Computation) -> float:
        """Bytes this op reads from and writes to HBM (arrays in VMEM / SMEM cost nothing)."""
        code, a = instr.opcode, instr.arrays
        if code == "copy-start":  # (destination, source, context)
            return a[0].bytes * ((a[0].memory_space == 0) + (a[1].memory_space == 0))
        if code == "slice-start":  # ((source), destination, context)
            return a[1].bytes * ((a[0].memory_space == 0) + (a[1].memory_space == 0))
        if code == "dynamic-slice":  # reads only the slice
            return a[0].bytes * ((_space(comp, instr.operands[0]) == 0) + (a[0].memory_space == 0))
        if code == "dynamic-update-slice":  # in place: reads and writes only the update
            update = comp.instrs[instr.operands[1]].arrays[0]
            return update.bytes * ((update.memory_space == 0) + (a[0].memory_space == 0))
        if code == "fusion":
            return self.fusion_bytes(instr, comp)
        return instr.hbm_bytes + sum(comp.instrs[o].hbm_bytes for o in instr.operands if o in comp.instrs)

    def fusion_bytes(self, instr: Instr, comp: Computation) -> float:
        fused = self.comps[_called(instr, "calls")[0]]
        reads = sum(self.param_read_bytes(fused, fused.parameter(i))
                    for i in range(len(instr.operands)) if fused.parameter(i).hbm_bytes)
        root = fused.root
        if _collective_buffer(root):
            return reads
        elements = [fused.instrs[o] for o in root.operands] if root.opcode == "tuple" else [root]
        if len(elements) != len(instr.arrays):
            return reads + instr.hbm_bytes
        writes = sum(_written_bytes(e, fused) for e, out in zip(elements, instr.arrays) if out.memory_space == 0)
        return reads + writes

    def param_read_bytes(self, comp: Computation, value: Instr) -> float:
        """Bytes of `value` (an HBM array) the fused ops read, as XLA's cost analysis (and libtpu's) counts them: a
        slice's worth where they only slice it, each nested fusion's own reads (a nested fusion is recomputed
        where it is used), and one read shared by every other user."""
        if value.is_root:  # a nested fusion's result (a bitcast of a matmul's operand): its user reads it whole
            return value.bytes
        read, shared = 0.0, False
        for user in comp.users[value.name]:
            if _collective_buffer(user) or user.opcode == "tuple" and user.is_root:
                pass  # a collective's buffer, or one passed through to the fusion's result, unread by its ops
            elif user.opcode in ("dynamic-slice", "slice", "gather") and user.operands[0] == value.name:
                read += user.bytes
            elif user.opcode in ("dynamic-update-slice", "scatter") and user.operands[0] == value.name:
                pass  # updated in place: only the update is written (charged as the fusion's output)
            elif user.opcode == "bitcast":
                read += self.param_read_bytes(comp, user)
            elif user.opcode == "fusion":
                nested = self.comps[_called(user, "calls")[0]]
                read += sum(self.param_read_bytes(nested, nested.parameter(i))
                            for i, o in enumerate(user.operands) if o == value.name)
            elif not shared:
                read, shared = read + value.bytes, True
        return read

    def collective(self, instr: Instr, start: Instr, kind: str | None = None) -> Cost:
        """`start` carries the replica groups (an async pair's first half); `kind` overrides the opcode's."""
        kind = kind or instr.opcode.removesuffix("-done").removesuffix("-start")
        groups = replica_groups(start.attrs, self.devices)
        n = max(len(g) for g in groups) if kind != "collective-permute" else 2
        if n <= 1:
            return Cost()
        # B is the full array: the all-gather's output, the reduce-scatter's input (an all-reduce's array when
        # libtpu wrote the reduce-scatter as one)
        scatter = kind == "reduce-scatter" and instr.opcode.startswith("reduce-scatter")
        nbytes = instr.bytes * (n if scatter else 1)
        axis = mesh_axis(groups, self.mesh_shape)
        seconds = collective_seconds(kind, n, nbytes, self.chip)
        return Cost(collectives={(kind, axis): Collective(kind, axis, 1, nbytes, seconds, exposed=seconds)})

    def loop(self, instr: Instr, comp: Computation) -> Cost:
        trips = trip_count(instr, comp, self.comps)
        cost = Cost()
        cost.add(self.computation(_called(instr, "body")[0]), trips or 1)
        cost.unknown_loops += trips is None
        return cost


ASYNC_COPIES = {"copy-start", "slice-start"}

# The splash kernels (gpt2/splash.py) by name, and the [bq, K] × [K, bkv] matmuls each runs per computed block:
# forward QKᵀ and PV; dq recomputes QKᵀ, then dP = dO Vᵀ and dQ = dS K; dkv recomputes QKᵀ and dP, then
# dV = Pᵀ dO and dK = dSᵀ Q (splash_attention_kernel.py's _flash_attention_kernel, _flash_attention_dq_kernel,
# _flash_attention_dkv_kernel). Each of the three also takes one exp per score of the block: the forward's
# softmax numerator, and the backward kernels' P = exp(S - logsumexp), recomputed rather than stored.
SPLASH_MATMULS = {"splash_mha_fwd": 2, "splash_mha_dq": 3, "splash_mha_dkv": 4}
SPLASH_EXPS_PER_SCORE = 1


def splash_work(instr: Instr, comp: Computation) -> tuple[float, float]:
    """A splash kernel's (MXU FLOPs, exps), from its operands: q [b, h, T, K] and its block mask [., nq, nkv], of
    whose blocks a causal mask computes those on or below the diagonal (the kernel skips the rest). libtpu
    cannot cost a Pallas kernel; these are the counts its model charges the equivalent XLA dots and exp.
    (0, 0) for another Pallas kernel (its work is not stated anywhere in the HLO)."""
    matmuls = next((n for name, n in SPLASH_MATMULS.items() if instr.name.startswith(name)), None)
    operands = [comp.instrs[o].arrays[0] for o in instr.operands if o in comp.instrs and comp.instrs[o].arrays]
    q = next((a for a in operands if len(a.dims) == 4 and a.dtype in ("bf16", "f32", "f16")), None)
    mask = operands[0] if operands and len(operands[0].dims) == 3 else None
    if matmuls is None or q is None or mask is None:
        return 0.0, 0.0
    b, h, T, K = q.dims
    nq, nkv = mask.dims[1:]
    bq, bkv = T // nq, T // nkv
    blocks = sum(1 for i in range(nq) for j in range(nkv) if j * bkv <= i * bq + bq - 1)  # causal
    scores = b * h * blocks * bq * bkv
    return 2.0 * matmuls * scores * K, SPLASH_EXPS_PER_SCORE * scores


def _overlapped(collectives: Cost, covered: float) -> Cost:
    """An async pair's collectives with `covered` seconds of ops between its halves hiding them (a copy: the
    walker's costs are cached)."""
    total = collectives.collective_s
    share = max(0.0, total - covered) / total if total else 0.0
    return Cost(collectives={key: dataclasses.replace(c, exposed=c.seconds * share)
                             for key, c in collectives.collectives.items()})


def _called(instr: Instr, *keys: str) -> list[str]:
    names = []
    for key in keys:
        value = instr.attr(key)
        names += [n.strip().lstrip("%") for n in value.strip("{}").split(",")] if value else []
    return names


def _space(comp: Computation, name: str) -> int:
    return comp.instrs[name].arrays[0].memory_space if name in comp.instrs else 0


def _collective_buffer(instr: Instr) -> bool:
    """A collective inside a fusion, or the custom call that starts or ends an async one: the buffers it reads and
    writes are the collective's traffic (its ICI time), not the fusion's (a matmul that runs beside it passes
    them through)."""
    target = (instr.attr("custom_call_target") or "").strip('"')
    return instr.opcode in COLLECTIVES or target in ("AsyncCollectiveStart", "AsyncCollectiveDone")


def _written_bytes(element: Instr, fused: Computation) -> float:
    if element.opcode == "parameter" or _collective_buffer(element):
        return 0.0  # passed through (the fusion's result aliases its operand), or the collective's to write
    in_place = element.opcode in ("dynamic-update-slice", "scatter")
    if in_place and fused.instrs[element.operands[0]].opcode == "parameter":
        update = element.operands[1 if element.opcode == "dynamic-update-slice" else 2]
        return fused.instrs[update].bytes  # only the update is written
    return element.bytes


def trip_count(instr: Instr, comp: Computation, comps: dict[str, Computation]) -> int | None:
    """A while loop's trip count: libtpu's `known_trip_count` if given, else read off `i < N` in its condition."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', instr.attrs)
    if known:
        return int(known.group(1))
    cond = comps[_called(instr, "condition")[0]]
    root = cond.root
    direction = re.search(r"direction=(\w+)", root.attrs)
    if root.opcode != "compare" or not direction or len(root.operands) != 2:
        return None
    lhs, rhs = (cond.instrs.get(o) for o in root.operands)
    if not (lhs and rhs and lhs.opcode == "get-tuple-element" and rhs.opcode == "constant"):
        return None
    bound, index = int(rhs.operands[0]), int(lhs.attr("index"))
    start = _initial_value(instr, comp, index)
    extra = {"LT": 0, "LE": 1, "NE": 0}.get(direction.group(1))
    return None if extra is None else max(bound - start + extra, 0)


def _initial_value(instr: Instr, comp: Computation, index: int) -> int:
    """The loop counter's start, when it is a literal in the while's operand tuple; scans start at 0."""
    init = comp.instrs.get(instr.operands[0])
    value = comp.instrs.get(init.operands[index]) if init and init.opcode == "tuple" else None
    while value is not None and value.opcode == "copy":
        value = comp.instrs.get(value.operands[0])
    if value is not None and value.opcode == "constant":
        try:
            return int(value.operands[0])
        except ValueError:
            pass
    return 0


# ---------------------------------------------------------------------------------------------- the estimate

@dataclasses.dataclass(frozen=True)
class StepTimeEstimate:
    """Predicted time of one optimizer step on one chip, from the compiled program (not a measurement).

    Each op the TensorCore runs costs the larger of its compute and HBM times at libtpu's rates (trainer/op_cost.py);
    roofline_s is their sum, one op after another (async copies are DMAs beside them). A collective adds the part
    of its ICI time that the ops scheduled between its start and done do not cover (all of it when synchronous):
    predicted_s = max(roofline_s + exposed_s, hbm_s). `predicted_mfu` is the MFU at that time, and what the
    planner ranks by. lower_bound_s = max(compute_s, hbm_s, collective_s) (`mfu_bound` its MFU) is what the three
    resources allow if everything overlapped; no_overlap_s (every collective in series) the pessimistic end.
    """

    chip: Chip
    flops: float  # per step: MXU FLOPs of the compiled program, loops multiplied out
    hbm_bytes: float  # per step: HBM bytes read + written
    compute_s: float  # Σ over ops of their MXU / transcendental time
    hbm_s: float  # hbm_bytes at libtpu's HBM rate
    roofline_s: float  # Σ over ops of max(compute, HBM), async copies left out
    collectives: tuple[Collective, ...]  # per step, largest first
    model_flops: float | None = None  # per step per chip (6N + attention), for MFU
    opaque_kernels: float = 0
    unknown_loops: int = 0
    memory_bound_s: float = 0.0  # the part of roofline_s in ops limited by HBM rather than the MXU
    splash_kernels: float = 0  # splash attention kernel calls per step, costed from their block shapes

    @property
    def collective_s(self) -> float:
        return sum(c.seconds for c in self.collectives)

    @property
    def exposed_s(self) -> float:
        return sum(c.exposed for c in self.collectives)

    @property
    def lower_bound_s(self) -> float:
        return max(self.compute_s, self.hbm_s, self.collective_s)

    @property
    def no_overlap_s(self) -> float:
        """The roofline plus every collective in series: what the step takes if nothing overlaps."""
        return self.roofline_s + self.collective_s

    @property
    def predicted_s(self) -> float:
        return max(self.roofline_s + self.exposed_s, self.hbm_s)

    @property
    def predicted_mfu(self) -> float | None:
        return self.model_flops / (self.predicted_s * self.chip.peak_flops) if self.model_flops else None

    @property
    def mfu_bound(self) -> float | None:
        return self.model_flops / (self.lower_bound_s * self.chip.peak_flops) if self.model_flops else None

    @property
    def bottleneck(self) -> str:
        """What sets the predicted time: exposed collectives (named by their largest kind and mesh axis) when they
        outweigh the ops, HBM traffic, or the ops in series — "compute" when most of their time is in MXU-bound
        ops, else "memory"."""
        if self.hbm_s > self.roofline_s + self.exposed_s:
            return "memory (HBM)"
        if self.exposed_s > self.roofline_s:
            worst = max(self.collectives, key=lambda c: c.exposed)
            return f"collectives: {worst.kind} over {worst.axis}"
        share = self.memory_bound_s / self.roofline_s if self.roofline_s else 0.0
        return f"memory ({share:.0%} of op time)" if share > 0.5 else f"compute ({1 - share:.0%} of op time)"

    def row(self) -> dict[str, float | str | None]:
        """One line of a table ranking candidate configurations."""
        return {"step_ms": self.predicted_s * 1e3, "mfu": self.predicted_mfu, "compute_ms": self.compute_s * 1e3,
                "hbm_ms": self.hbm_s * 1e3, "collective_ms": self.collective_s * 1e3,
                "exposed_ms": self.exposed_s * 1e3, "ops_ms": self.roofline_s * 1e3,
                "no_overlap_ms": self.no_overlap_s * 1e3, "bottleneck": self.bottleneck}

    def lines(self) -> list[str]:
        ms = lambda s: f"{s * 1e3:8.2f} ms"  # noqa: E731
        chip, mfu, rates = self.chip, self.predicted_mfu, op_cost.RATES[self.chip.name]
        lines = [
            "predicted from the compiled program (not measured), per step per chip, at libtpu's cost model's rates:",
            f"  compute     {ms(self.compute_s)}  {self.flops:.3e} MXU FLOPs at {rates.mxu_flops_per_s / 1e12:.0f}"
            f" TFLOP/s, transcendentals at {rates.transcendentals_per_s / 1e12:.2f} T/s, loops multiplied out",
            f"  HBM         {ms(self.hbm_s)}  {self.hbm_bytes / 2**30:.2f} GiB read + written at"
            f" {rates.hbm_bytes_per_s / 1e9:.0f} GB/s",
            f"  collectives {ms(self.collective_s)}  ICI: a ring over a mesh axis {chip.ring_bytes_per_s / 1e9:.0f}"
            f" GB/s, one link {chip.ici_link_bytes_per_s / 1e9:.0f} GB/s; {self.exposed_s * 1e3:.2f} ms exposed",
            *(f"    {c.row()}" for c in self.collectives),
            f"  lower bound {ms(self.lower_bound_s)}  max(compute, HBM, collectives)"
            + (f" -> MFU <= {self.mfu_bound:.1%}" if mfu else ""),
            f"  op by op    {ms(self.roofline_s)}  each op at max(its compute, its HBM), one after another"
            f" ({self.memory_bound_s / max(self.roofline_s, 1e-12):.0%} in HBM-bound ops);"
            f" {self.no_overlap_s * 1e3:.2f} ms with every collective in series",
            f"  predicted   {ms(self.predicted_s)}  op by op + exposed collectives (at least HBM)"
            + (f" -> predicted MFU {mfu:.1%}" if mfu else "") + f"; bottleneck: {self.bottleneck}",
        ]
        if self.splash_kernels:
            lines.append(f"  splash attention: {self.splash_kernels:g} kernel calls costed from their block shapes"
                         " (the causal blocks' matmuls at the MXU rate, then one exp per score), as libtpu cannot")
        if self.opaque_kernels:
            lines.append(f"  not counted: the FLOPs inside {self.opaque_kernels:g} Pallas kernel calls other than"
                         " splash attention's (their HBM traffic is)")
        if self.unknown_loops:
            lines.append(f"  not counted: the repeats of {self.unknown_loops} loops of unknown trip count (run once)")
        return lines


def estimate(compiled, chip: Chip | str, mesh, *, steps_per_call: int = 1,
             model_flops_per_step: float | None = None) -> StepTimeEstimate:
    """The step-time estimate of a compiled jitted call (`jax.jit(f).lower(...).compile()`) for one chip.

    Args:
      compiled: the compiled call; its `as_text()` is the optimized, scheduled HLO module.
      chip: a `Chip` or a key of CHIPS ("v5e", ...).
      mesh: the `jax.sharding.Mesh` the call was compiled for; device i of the program is mesh position i.
      steps_per_call: optimizer steps one call runs (the K-step scan): figures are per step.
      model_flops_per_step: per chip (6N + attention), for the predicted MFU.
    """
    return estimate_hlo(compiled.as_text(), chip, dict(mesh.shape), steps_per_call=steps_per_call,
                        model_flops_per_step=model_flops_per_step)


def estimate_hlo(text: str, chip: Chip | str, mesh_shape: dict[str, int], *, steps_per_call: int = 1,
                 model_flops_per_step: float | None = None) -> StepTimeEstimate:
    chip = CHIPS[chip] if isinstance(chip, str) else chip
    comps, entry = parse_hlo(text)
    cost = _Walker(comps, chip, mesh_shape).computation(entry)
    k = steps_per_call
    collectives = tuple(sorted(
        (Collective(c.kind, c.axis, c.count / k, c.bytes / k, c.seconds / k, c.exposed / k)
         for c in cost.collectives.values()),
        key=lambda c: -c.seconds))
    return StepTimeEstimate(
        chip=chip, flops=cost.flops / k, hbm_bytes=cost.hbm_bytes / k, compute_s=cost.compute_s / k,
        hbm_s=cost.hbm_s / k, roofline_s=cost.roofline_s / k, collectives=collectives,
        model_flops=model_flops_per_step, opaque_kernels=cost.opaque_kernels / k, unknown_loops=cost.unknown_loops,
        memory_bound_s=cost.memory_bound_s / k, splash_kernels=cost.splash_kernels / k,
    )
