"""What `plan.py --topology T` prints: a first line saying what is compiled for what (before the compile), then a
verdict — fits or not, the predicted step with its range, tokens/s per chip, MFU in both conventions — then the
breakdown behind it. Every figure is predicted from the compiled program, not measured.
"""

from __future__ import annotations

import dataclasses

from planning.compile_store import STORE
from planning.compile_time import minutes
from planning.step_report import StepTimeEstimate
from trainer import libtpu_env
from trainer.program.memory import program_bytes


def compile_line(preset: str, topology: str, mesh_shape: dict[str, int], batch: int, seq_len: int,
                 grad_accum: int, steps_per_call: int, expected: tuple[float, str] | None = None) -> str:
    """The line printed before a compile: what is compiled for what, with which flags, and how long it may take
    (`expected`: seconds and their basis, planning/compile_time.py; None: the store has this compile)."""
    chips = 1
    for size in mesh_shape.values():
        chips *= size
    mesh = " × ".join(f"{axis} {size}" for axis, size in mesh_shape.items())
    rows = batch / chips * mesh_shape.get("tensor", 1)  # the batch is split over data × fsdp
    micro = f" in {grad_accum} micro-batches" if grad_accum > 1 else ""
    generation = topology.split(":")[0]
    flags = ("LIBTPU_INIT_ARGS as set" if not libtpu_env.compile_options(generation)
             else f"the libtpu flags train.py sets on {generation} (trainer/libtpu_env.py)")
    if expected is None:
        when = f" Compiled before: {STORE} has it, so this answers in seconds."
    else:
        when = (f" The compile should take {minutes(expected[0])} here ({expected[1]}); {STORE} keeps the result, so a"
                " re-run answers in seconds.")
    return (f"Compiling {preset}'s train call for {topology}: {chips} chip{'s' * (chips > 1)}, mesh {mesh}, batch"
            f" {batch} × {seq_len} tokens ({rows:g} sequences per chip{micro}), {steps_per_call}"
            f" step{'s' * (steps_per_call > 1)} per call, with {flags}.{when}")


@dataclasses.dataclass(frozen=True)
class AotReport:
    topology: str
    devices: int
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    hbm_bytes: int
    flops_per_step: float  # per device, from XLA's cost analysis (a loop body counted once)
    model_flops_per_step: float  # per device, 6N + attention
    optimal_seconds: float  # libtpu's cost model for the whole call (< 0: none; see aot.compile_for_topology)
    steps_per_call: int
    step_time: StepTimeEstimate  # predicted from the compiled program, per step
    libtpu_vmem_step_s: float  # the same with on-chip memory counted as libtpu's cost model counts it
    from_store: bool = False  # the compile was read back from planning/compile_store.py's store
    slices: int = 1  # slices joined by DCN (`v5e:16x16*2`); the program compiled is one slice's
    tokens_per_step: int = 0  # the global batch's tokens
    preset: str = ""

    @property
    def total_bytes(self) -> int:
        return program_bytes(self.argument_bytes, self.output_bytes, self.alias_bytes, self.temp_bytes)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.hbm_bytes

    def text(self, verbose: bool = False) -> str:
        return "\n".join([*self.verdict(), "", *self.breakdown(verbose)])

    def verdict(self) -> list[str]:
        gib = 2**30
        e, what = self.step_time, f"{self.preset} on {self.topology}" if self.preset else self.topology
        where = (f"{self.devices} chip{'s' * (self.devices > 1)}"
                 + (f" in {self.slices} slices" if self.slices > 1 else ""))
        fits = (f"yes, {self.total_bytes / gib:.2f} of {self.hbm_bytes / gib:.2f} GiB HBM per chip"
                f" ({(self.hbm_bytes - self.total_bytes) / gib:.2f} GiB to spare)" if self.fits else
                f"NO: {self.total_bytes / gib:.2f} GiB per chip, {(self.total_bytes - self.hbm_bytes) / gib:.2f} GiB"
                f" more than the chip's {self.hbm_bytes / gib:.2f} GiB HBM")
        tokens = self.tokens_per_step / self.devices / e.predicted_s
        lines = [
            f"{what} ({where}), predicted from the compiled program, not measured"
            + (f" (read back from {STORE})" if self.from_store else "") + ":",
            f"  fits        {fits}",
            f"  step        {e.predicted_s * 1e3:.1f} ms; {e.expected_range()}",
            f"  tokens/s    {tokens:,.0f} per chip"
            + (f", {tokens * self.devices:,.0f} on all {self.devices} chips" if self.devices > 1 else ""),
        ]
        if e.predicted_mfu:
            lines.append(f"  MFU         {e.predicted_mfu:.1%} counting 6N + attention over every query-key pair"
                         " (PaLM, nanoGPT)" + (f"; {e.predicted_mfu_causal:.1%} counting the causal pairs only"
                                               " (MaxText, llm.c)" if e.predicted_mfu_causal else ""))
        lines.append(f"  bottleneck  {e.bottleneck}; {e.exposed_s * 1e3:.1f} ms of collectives exposed")
        return lines

    def breakdown(self, verbose: bool = False) -> list[str]:
        gib = lambda b: f"{b / 2**30:8.2f} GiB"  # noqa: E731
        lines = [
            "Memory per chip:",
            f"  arguments   {gib(self.argument_bytes)}",
            f"  outputs     {gib(self.output_bytes)}  ({gib(self.alias_bytes).strip()} of them alias donated"
            " arguments)",
            f"  temporaries {gib(self.temp_bytes)}",
            f"  total       {gib(self.total_bytes)}  of {gib(self.hbm_bytes).strip()} HBM",
            "Step time per chip per step:",
            *("  " + line for line in self.step_time.lines()),
            f"  The range above is for this accounting of on-chip memory (VMEM costs no HBM time; prefetches run"
            f" beside the compute), the one the back-test compares with published runs. libtpu's own cost model"
            f" charges VMEM at the HBM rate and prefetches in series: {self.libtpu_vmem_step_s * 1e3:.1f} ms"
            " (docs/aot_planning.md, On-chip memory).",
        ]
        if verbose:
            lines.append(f"  XLA's cost analysis: {self.flops_per_step:.3e} FLOPs per call (each loop body counted"
                         f" once), against {self.model_flops_per_step:.3e} model FLOPs per step (6N + attention)")
            lines.append(f"  libtpu's cost model: {self.optimal_seconds:.3g} s per call" +
                         ("" if self.optimal_seconds > 0 else " (negative: it gives up on this program)"))
        return lines
