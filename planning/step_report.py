"""The step-time estimate's figures and its report: the predicted step, MFU in both conventions, the bottleneck and
the range the back-test against published measurements gives for its regime (planning/backtest_band.py).

planning/step_time.py makes a `StepTimeEstimate` from a compiled program; `plan.py` prints its `lines()` and the
planner ranks candidates by its `row()`.
"""

from __future__ import annotations

import dataclasses

from planning.chips import Chip
from planning import op_cost
from planning.backtest_band import Band, band, span
from planning.collectives import DCN_STEP_S, ICI_HOP_S, Collective


@dataclasses.dataclass(frozen=True)
class StepTimeEstimate:
    """Predicted time of one optimizer step on one chip, from the compiled program (not a measurement).

    Each op the TensorCore runs costs the larger of its compute and HBM times at libtpu's rates (trainer/op_cost.py);
    roofline_s is their sum, one op after another (async copies are DMAs beside them). A collective adds the part
    of its ICI time that the ops scheduled between its start and done do not cover (all of it when synchronous),
    and every op its fixed cost: predicted_s = max(roofline_s + fixed_s + exposed_s, hbm_s, dispatch_s), the last
    the host's dispatch of the call per step. `predicted_mfu` is the MFU at that time, and what the
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
    model_flops: float | None = None  # per step per chip (6N + attention over all query-key pairs), for MFU
    causal_model_flops: float | None = None  # the same counting only the causal pairs (MaxText's, llm.c's MFU)
    opaque_kernels: float = 0
    unknown_loops: int = 0
    memory_bound_s: float = 0.0  # the part of roofline_s in ops limited by HBM rather than the MXU
    splash_kernels: float = 0  # splash attention kernel calls per step, costed from their block shapes
    ops: float = 0  # ops per step the TensorCore runs one after another
    fixed_s: float = 0.0  # their fixed cost (planning/step_time.py's OP_OVERHEAD_S each), in series
    dispatch_s: float = 0.0  # the host's dispatch of the call, per step: a floor, as it overlaps the device's work

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
        return self.roofline_s + self.fixed_s + self.collective_s

    @property
    def predicted_s(self) -> float:
        return max(self.roofline_s + self.fixed_s + self.exposed_s, self.hbm_s, self.dispatch_s)

    @property
    def predicted_mfu(self) -> float | None:
        return self.model_flops / (self.predicted_s * self.chip.peak_flops) if self.model_flops else None

    @property
    def predicted_mfu_causal(self) -> float | None:
        return self.causal_model_flops / (self.predicted_s * self.chip.peak_flops) if self.causal_model_flops else None

    @property
    def exposed_share(self) -> float:
        return self.exposed_s / self.predicted_s if self.predicted_s else 0.0

    def expected(self) -> tuple[float, float, Band] | None:
        """(fastest, slowest) step the back-test's runs of this regime put around the prediction, and their band;
        None where the back-test has no comparable run (planning/backtest_band.py)."""
        b = band(self.compute_s, self.exposed_share)
        if b is None:
            return None
        # no faster than the lower bound: every resource at libtpu's rate (the MXU's peak), perfectly overlapped
        return max(self.predicted_s * b.lo, self.lower_bound_s), self.predicted_s * b.hi, b

    def expected_range(self) -> str:
        """The step and MFU range the back-test gives this prediction, or why it gives none."""
        e = self.expected()
        if e is None:
            return (f"no comparable measured run: the back-test's runs span {span()}, this program"
                    f" {self.compute_s * 1e3:.0f} ms with {self.exposed_share:.0%} of its step in exposed collectives")
        fastest, slowest, b = e
        mfu = self.predicted_mfu
        mfus = f", MFU {mfu * self.predicted_s / slowest:.0%}–{mfu * self.predicted_s / fastest:.0%}" if mfu else ""
        return (f"expect {fastest * 1e3:.0f}–{slowest * 1e3:.0f} ms{mfus} ({b.text()}: docs/aot_planning.md,"
                " Back-test)")

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
        return {"step_ms": self.predicted_s * 1e3, "mfu": self.predicted_mfu, "mfu_causal": self.predicted_mfu_causal,
                "compute_ms": self.compute_s * 1e3,
                "hbm_ms": self.hbm_s * 1e3, "collective_ms": self.collective_s * 1e3,
                "exposed_ms": self.exposed_s * 1e3, "ops_ms": self.roofline_s * 1e3,
                "no_overlap_ms": self.no_overlap_s * 1e3, "bottleneck": self.bottleneck}

    def lines(self) -> list[str]:
        """The breakdown behind the predicted step, per step per chip (the verdict is planning/aot.py's)."""
        ms = lambda s: f"{s * 1e3:8.2f} ms"  # noqa: E731
        chip, mfu, rates = self.chip, self.predicted_mfu, op_cost.RATES[self.chip.name]
        lines = [
            f"compute     {ms(self.compute_s)}  {self.flops:.3e} MXU FLOPs at {rates.mxu_flops_per_s / 1e12:.0f}"
            f" TFLOP/s, transcendentals at {rates.transcendentals_per_s / 1e12:.2f} T/s (libtpu's rates)",
            f"HBM         {ms(self.hbm_s)}  {self.hbm_bytes / 2**30:.2f} GiB read + written at"
            f" {rates.hbm_bytes_per_s / 1e9:.0f} GB/s",
            f"collectives {ms(self.collective_s)}  ICI: a ring over a mesh axis {chip.ring_bytes_per_s / 1e9:.0f}"
            f" GB/s, one link {chip.ici_link_bytes_per_s / 1e9:.0f} GB/s, at least {ICI_HOP_S * 1e6:.0f} µs a hop;"
            f" {self.exposed_s * 1e3:.2f} ms exposed"
            + (f"; DCN {chip.dcn_bytes_per_s / 1e9:.2f} GB/s per chip (a host's NICs over its {chip.chips_per_host}"
               f" chips) and {DCN_STEP_S * 1e6:.0f} µs a step" if any(c.over_dcn for c in self.collectives) else ""),
            *(f"  {c.row()}" for c in self.collectives),
            f"op by op    {ms(self.roofline_s)}  each op at max(its compute, its HBM), one after another"
            f" ({self.memory_bound_s / max(self.roofline_s, 1e-12):.0%} in HBM-bound ops)",
            f"fixed costs {ms(self.fixed_s)}  {self.ops:,.0f} ops at {self.fixed_s / max(self.ops, 1) * 1e6:.2g} µs"
            f" each (planning/step_time.py's OP_OVERHEAD_S); the host's dispatch of the call"
            f" {self.dispatch_s * 1e3:.2f} ms per step, beside the device's work",
            f"predicted   {ms(self.predicted_s)}  op by op + fixed costs + exposed collectives (at least HBM and"
            " dispatch)"
            + (f": MFU {mfu:.1%}" if mfu else ""),
            f"lower bound {ms(self.lower_bound_s)}  max(compute, HBM, collectives), everything overlapped"
            + (f": MFU at most {self.mfu_bound:.1%}" if mfu else "")
            + f"; {self.no_overlap_s * 1e3:.2f} ms with nothing overlapped",
        ]
        if self.splash_kernels:
            lines.append(f"splash attention: {self.splash_kernels:g} kernel calls a step, costed from their block"
                         " shapes (libtpu's model cannot cost Pallas kernels): the causal blocks' matmuls at the MXU"
                         " rate, then one exp per score")
        if self.opaque_kernels:
            lines.append(f"not counted: the FLOPs inside {self.opaque_kernels:g} Pallas kernel calls other than"
                         " splash attention's (their HBM traffic is)")
        if self.unknown_loops:
            lines.append(f"not counted: the repeats of {self.unknown_loops} loops of unknown trip count (run once)")
        return lines
