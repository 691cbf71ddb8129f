"""A step-time estimate of a compiled TPU program, read from its optimized HLO: each op at libtpu's cost model's rates
plus the collectives (ICI; DCN between slices) that the schedule leaves exposed.

libtpu's own cost model (`compiled.cost_analysis()["optimal_seconds"]`) gives up on our train call (it returns a
negative number), and XLA's flop count covers a loop body once. This module walks the compiled program's HLO text
(`compiled.as_text()`, the module libtpu scheduled) instead, costing each op as libtpu's model costs it on its own
(planning/op_cost.py; planning/calibrate.py checks the two agree):

- compute: the MXU's FLOPs (convolutions and dots, from their shapes) and the transcendentals (exp, tanh, rsqrt, ...
  one per element), each at libtpu's rate for the chip; splash attention's Pallas kernels from their block shapes;
- HBM: the bytes each op the TensorCore runs (a fusion, a copy, an async prefetch) reads from and writes to HBM, at
  their stored size (tile padding included), at libtpu's HBM rate; arrays the compiler placed in VMEM (layout
  memory space S(1)) or SMEM cost nothing;
- while loops (scans over layers, the K-step scan, gradient accumulation) multiply their body by the trip count;
  a conditional costs its most expensive branch (the train call's "active" branch is the whole step);
- each collective's time comes from its bytes and the mesh axis its replica groups run over, at the ICI bandwidth
  of a bidirectional ring along that axis, a transfer between slices at the hosts' DCN bandwidth (perf/collectives.py).
  An async one is hidden by the ops scheduled between its start and its done (the text's order is the schedule); the
  rest of it, and all of a synchronous one, is exposed.

The predicted step is the ops in series plus the exposed collectives, and no less than the HBM traffic (async
prefetches are DMAs beside the compute). Everything here is a prediction from the compiled program, not a
measurement.

`estimate(compiled, chip, mesh)` is the entry point (planning/aot.py's report; a planner ranking candidate
configurations by `StepTimeEstimate.row()`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from functools import cached_property

import numpy as np

from planning.chips import CHIPS, Chip
from planning import op_cost
from planning.collectives import COLLECTIVES, Collective, collective_seconds, dcn_collective, dcn_kind
from planning.hlo import (Computation, Instr, called, memory_space, mesh_axis, parse_hlo, replica_groups,
                              torus_extents, trip_count)
from planning.step_report import StepTimeEstimate

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
    ops: float = 0  # ops the TensorCore runs one after another (fusions, kernels, copies), loops multiplied out

    @property
    def collective_s(self) -> float:
        return sum(c.seconds for c in self.collectives.values())

    @property
    def exposed_s(self) -> float:
        return sum(c.exposed for c in self.collectives.values())

    def add(self, other: Cost, times: float = 1.0) -> None:
        for f in ("flops", "hbm_bytes", "compute_s", "hbm_s", "roofline_s", "memory_bound_s", "opaque_kernels",
                  "splash_kernels", "ops"):
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

    def __init__(self, comps: dict[str, Computation], chip: Chip, mesh_shape: dict[str, int], *,
                 copies_in_series: bool = False, slices: int = 1, latency: bool = True, torus=None):
        self.comps, self.chip, self.mesh_shape, self.slices = comps, chip, mesh_shape, slices  # one slice's mesh
        self.latency, self.torus = latency, torus  # collectives' hop latency, on these chip coordinates
        self.copies_in_series = copies_in_series  # libtpu's accounting: see estimate_hlo
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
        Spellings: `all-gather-start`/`-done` (and the other collectives'), `async-start`/`-done` around a
        reduce-scatter or all-to-all, libtpu's async collective fusions (fused roots AsyncCollectiveStart /
        AsyncCollectiveDone, paired by their collective's channel), and across slices a megascale `send`/`send-done`."""
        code = instr.opcode
        if dcn_kind(instr) or code == "send-done" and "megascale" in instr.attrs:
            return ("start", instr.name) if code == "send" else ("done", instr.operands[0])
        for half in ("start", "done"):
            if code.removesuffix(f"-{half}") in COLLECTIVES and code.endswith(f"-{half}"):
                return half, instr.name if half == "start" else instr.operands[0]
        if code == "async-start" and self.computation(called(instr, "calls")[0]).collectives:
            return "start", instr.name
        if code == "async-done":
            return "done", instr.operands[0]
        if code == "fusion":
            return self._async_fusions.get(called(instr, "calls")[0], (None, None))
        return None, None

    def async_collectives(self, done: Instr, start: Instr) -> Cost:
        if start.opcode == "send":
            c = dcn_collective(dcn_kind(start), self.slices, start.arrays[0].bytes, self.chip, self.latency)
            return Cost(collectives={(c.kind, c.axis): c})
        if start.opcode == "async-start":
            return self.computation(called(start, "calls")[0])
        if start.opcode == "fusion":
            return self.fused_collectives(called(start, "calls")[0], async_too=True)
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
            return max((self.computation(b) for b in called(instr, "branch_computations", "true_computation",
                                                              "false_computation")),
                       key=lambda c: c.roofline_s + c.exposed_s, default=Cost())
        if code == "async-start" and self.async_role(instr)[0] == "start" or "megascale" in instr.attrs:
            return Cost()  # its collective is charged at its done (a DCN transfer's send and recv: at the send's)
        if code in ("call", "async-start"):
            return self.computation(called(instr, "to_apply", "calls")[0])
        if code in COLLECTIVES:
            return self.collective(instr, instr)
        if self.copies_in_series and code in ASYNC_COPY_DONES:
            return self.roofline(instr, comp)
        if code in FREE or code.endswith("-done") or code.removesuffix("-start") in COLLECTIVES:
            return Cost()
        if code == "custom-call" and instr.attr("custom_call_target").strip('"') in FREE_CUSTOM_CALLS:
            return Cost()
        cost = self.roofline(instr, comp)
        if code == "fusion":
            cost.add(self.fused_collectives(called(instr, "calls")[0]))
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
                cost.add(self.fused_collectives(called(instr, "calls")[0], async_too))
        return cost

    def roofline(self, instr: Instr, comp: Computation) -> Cost:
        flops, nbytes = self.flops(instr, comp), self.hbm_bytes(instr, comp)
        kernel = instr.attr("custom_call_target") == '"tpu_custom_call"'
        work = op_cost.kernel_compute_seconds if kernel else op_cost.compute_seconds
        compute = work(self.rates, flops, self.transcendentals(instr, comp))
        memory = op_cost.memory_seconds(self.rates, nbytes)
        # an async copy (a prefetch into VMEM, an eviction) is a DMA beside the compute: it uses HBM bandwidth
        # but does not hold up the ops in series
        serial = 0.0 if instr.opcode in ASYNC_COPIES and not self.copies_in_series else max(compute, memory)
        return Cost(flops=flops, hbm_bytes=nbytes, compute_s=compute, hbm_s=memory, roofline_s=serial,
                    memory_bound_s=serial if memory > compute else 0.0, opaque_kernels=kernel and not flops,
                    splash_kernels=kernel and flops > 0, ops=float(serial > 0))

    def flops(self, instr: Instr, comp: Computation) -> float:
        """MXU FLOPs: convolutions, dots and splash's kernels, in fusions too."""
        if instr.opcode == "custom-call" and instr.attr("custom_call_target") == '"tpu_custom_call"':
            return op_cost.splash_work(instr, comp)[0]
        if instr.opcode == "convolution":
            return op_cost.convolution_flops(instr, comp)
        if instr.opcode == "dot":
            return op_cost.dot_flops(instr, comp)
        return self._fused_sum(instr, self.flops, self._flops)

    def transcendentals(self, instr: Instr, comp: Computation) -> float:
        """Elements of exp, log, tanh, rsqrt, ... results (one transcendental each), in fusions too."""
        if instr.opcode == "custom-call" and instr.attr("custom_call_target") == '"tpu_custom_call"':
            return op_cost.splash_work(instr, comp)[1]
        if instr.opcode in op_cost.TRANSCENDENTAL:
            return sum(math.prod(a.dims) for a in instr.arrays)
        return self._fused_sum(instr, self.transcendentals, self._transcendentals)

    def _fused_sum(self, instr: Instr, count, cache: dict[str, float]) -> float:
        """`count` summed over a fusion's instructions, once per fused computation."""
        if instr.opcode != "fusion":
            return 0.0
        name = called(instr, "calls")[0]
        if name not in cache:
            fused = self.comps[name]
            cache[name] = sum(count(i, fused) for i in fused.instrs.values())
        return cache[name]

    def hbm_bytes(self, instr: Instr, comp: Computation) -> float:
        """Bytes this op reads from and writes to HBM (arrays in VMEM / SMEM cost nothing)."""
        code, a = instr.opcode, instr.arrays
        if self.copies_in_series and code in ASYNC_COPIES | ASYNC_COPY_DONES:
            # libtpu: a copy's operand and its two-array result, then the done's result (module docstring)
            moved = a[1] if code == "slice-start" else a[0]
            return moved.bytes * (3 if code in ASYNC_COPIES else 1)
        if code == "copy-start":  # (destination, source, context)
            return a[0].bytes * ((a[0].memory_space == 0) + (a[1].memory_space == 0))
        if code == "slice-start":  # ((source), destination, context)
            return a[1].bytes * ((a[0].memory_space == 0) + (a[1].memory_space == 0))
        if code == "dynamic-slice":  # reads only the slice
            return a[0].bytes * ((memory_space(comp, instr.operands[0]) == 0) + (a[0].memory_space == 0))
        if code == "dynamic-update-slice":  # in place: reads and writes only the update
            update = comp.instrs[instr.operands[1]].arrays[0]
            return update.bytes * ((update.memory_space == 0) + (a[0].memory_space == 0))
        if code == "fusion":
            return self.fusion_bytes(instr, comp)
        return instr.hbm_bytes + sum(comp.instrs[o].hbm_bytes for o in instr.operands if o in comp.instrs)

    def fusion_bytes(self, instr: Instr, comp: Computation) -> float:
        fused = self.comps[called(instr, "calls")[0]]
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
                nested = self.comps[called(user, "calls")[0]]
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
        extents = torus_extents(groups, self.mesh_shape, self.torus) if kind != "collective-permute" else None
        seconds = collective_seconds(kind, n, nbytes, self.chip, extents, self.latency)
        return Cost(collectives={(kind, axis): Collective(kind, axis, 1, nbytes, seconds, exposed=seconds)})

    def loop(self, instr: Instr, comp: Computation) -> Cost:
        trips = trip_count(instr, comp, self.comps)
        cost = Cost()
        cost.add(self.computation(called(instr, "body")[0]), trips or 1)
        cost.unknown_loops += trips is None
        return cost


# What each op the TensorCore runs costs beyond its compute and HBM time (its issue, its pipeline's fill and drain).
# Google publishes no figure, and libtpu's own cost model charges none (a [8]-element multiply-add: 2 ns).
# Fitted to the back-test (planning/backtest.py --json, `fit_op_overhead`: least squares of log measured /
# predicted, 0-50 µs): 0 µs over the runs whose published step holds no one-time work (llama3_8b_v6e8, marin_520m,
# marin_1_2b, maxtext_22b_v4, maxtext_16b_v5e); 3.25 µs with every run, pulled by marin_150m_v4, whose figure carries
# its first step's compilation (docs/aot_planning.md, "Back-test"). No one constant per op explains the runs' errors:
# per run it would have to be 0.8 to 400 µs, or negative.
OP_OVERHEAD_S = 0.0
# What starting a call costs the host: JAX's C++ dispatch of a jitted call with 1,000 arguments took 516 µs
# (jit_simple_many_args_dispatch/num_args:1000, google/jax commit f5f5a00 "Replace apply_primitive internals with
# jax.jit"), 0.52 µs an argument. Dispatch is asynchronous: it overlaps the previous call's device time, so a step
# takes at least its call's dispatch over the steps in the call, and no longer otherwise.
DISPATCH_S_PER_ARGUMENT = 516e-6 / 1000

ASYNC_COPIES = {"copy-start", "slice-start"}
ASYNC_COPY_DONES = {"copy-done", "slice-done"}

def _overlapped(collectives: Cost, covered: float) -> Cost:
    """An async pair's collectives with `covered` seconds of ops between its halves hiding them (a copy: the
    walker's costs are cached)."""
    total = collectives.collective_s
    share = max(0.0, total - covered) / total if total else 0.0
    return Cost(collectives={key: dataclasses.replace(c, exposed=c.seconds * share)
                             for key, c in collectives.collectives.items()})


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


# ---------------------------------------------------------------------------------------------- the estimate

def estimate(compiled, chip: Chip | str, mesh, *, steps_per_call: int = 1,
             model_flops_per_step: float | None = None,
             causal_model_flops_per_step: float | None = None) -> StepTimeEstimate:
    """The step-time estimate of a compiled jitted call (`jax.jit(f).lower(...).compile()`) for one chip.

    Args:
      compiled: the compiled call; its `as_text()` is the optimized, scheduled HLO module.
      chip: a `Chip` or a key of CHIPS ("v5e", ...).
      mesh: the `jax.sharding.Mesh` the call was compiled for; device i of the program is mesh position i (of
        one slice's part of the mesh on several slices, whose devices carry a `slice_index`).
      steps_per_call: optimizer steps one call runs (the K-step scan): figures are per step.
      model_flops_per_step: per chip (6N + attention), for the predicted MFU; causal_model_flops_per_step: the
        same counting causal attention only.
    """
    slices = len({getattr(d, "slice_index", 0) for d in mesh.devices.flat})
    return estimate_hlo(compiled.as_text(), chip, dict(mesh.shape), steps_per_call=steps_per_call,
                        model_flops_per_step=model_flops_per_step,
                        causal_model_flops_per_step=causal_model_flops_per_step, slices=slices, torus=torus(mesh))


def torus(mesh) -> np.ndarray | None:
    """The chips' torus coordinates in mesh position order, one slice's ([devices, dims]); None off a TPU topology."""
    first = [d for d in mesh.devices.flat if getattr(d, "slice_index", 0) == 0]
    coords = [getattr(d, "coords", None) for d in first]
    return None if any(c is None for c in coords) else np.asarray(coords)


def estimate_hlo(text: str, chip: Chip | str, mesh_shape: dict[str, int], *, steps_per_call: int = 1,
                 model_flops_per_step: float | None = None, causal_model_flops_per_step: float | None = None,
                 libtpu_vmem: bool = False, slices: int = 1, fixed_costs: bool = True,
                 torus: np.ndarray | None = None) -> StepTimeEstimate:
    """`libtpu_vmem`: count on-chip memory as libtpu's cost model does — every array at the HBM rate whatever its
    memory space, an async copy into VMEM as its operand and its two-array result, then its done's result, in
    series with the ops — instead of VMEM as free and copies as DMAs beside the compute. `slices`: the slices
    the mesh's `data` axis spans (trainer/program/mesh.py); the program text is one slice's (perf/collectives.py).
    `torus`: the chips' coordinates in mesh position order (`torus(mesh)`), to count a collective's hops on.
    `fixed_costs=False` leaves out the fixed costs — OP_OVERHEAD_S, the collectives' latency, the call's dispatch —
    which libtpu's own model of an op lacks (the calibration compares the two)."""
    chip = CHIPS[chip] if isinstance(chip, str) else chip
    comps, entry = parse_hlo(re.sub(r"S\(\d+\)", "", text) if libtpu_vmem else text)
    one_slice = {**mesh_shape, "data": mesh_shape["data"] // slices} if slices > 1 else mesh_shape
    cost = _Walker(comps, chip, one_slice, copies_in_series=libtpu_vmem, slices=slices, latency=fixed_costs,
                   torus=torus).computation(entry)
    k = steps_per_call
    collectives = tuple(sorted(
        (Collective(c.kind, c.axis, c.count / k, c.bytes / k, c.seconds / k, c.exposed / k)
         for c in cost.collectives.values()),
        key=lambda c: -c.seconds))
    return StepTimeEstimate(
        chip=chip, flops=cost.flops / k, hbm_bytes=cost.hbm_bytes / k, compute_s=cost.compute_s / k,
        hbm_s=cost.hbm_s / k, roofline_s=cost.roofline_s / k, collectives=collectives,
        model_flops=model_flops_per_step, causal_model_flops=causal_model_flops_per_step,
        opaque_kernels=cost.opaque_kernels / k, unknown_loops=cost.unknown_loops,
        memory_bound_s=cost.memory_bound_s / k, splash_kernels=cost.splash_kernels / k, ops=cost.ops / k,
        fixed_s=cost.ops / k * OP_OVERHEAD_S if fixed_costs else 0.0,
        dispatch_s=_arguments(comps[entry]) * DISPATCH_S_PER_ARGUMENT / k if fixed_costs else 0.0,
    )


def _arguments(entry: Computation) -> int:
    """Arrays the call takes (its entry computation's parameters, tuples flattened)."""
    return sum(len(i.arrays) for i in entry.instrs.values() if i.opcode == "parameter")
