"""Ahead-of-time compilation of the real train call for a TPU topology, on a machine without TPUs.

`python plan.py --config gpt2_xl_pod --topology v5e:16x16` lowers and compiles exactly what a pod would run
(model, sharding rules, optimizer, K-step scan, batch) against libtpu's description of the topology, with
abstract arrays only, and reports per-device memory against the chip's HBM and a step-time estimate read from the
compiled program (planning/step_time.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re

import jax
from jax.experimental import topologies
from jax.sharding import Mesh

from configs.base import Config
from errors import ConfigError
from planning.chips import CHIPS, Chip
from planning.compile_store import STORE, CompiledProgram, compile_lowered
from planning.step_report import StepTimeEstimate
from planning.step_time import estimate_hlo
from trainer.program.mesh import build_mesh
from trainer.program.train_program import TrainProgram


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
    optimal_seconds: float  # libtpu's cost model for the whole call (< 0: none; see compile_for_topology)
    steps_per_call: int
    step_time: StepTimeEstimate  # predicted from the compiled program, per step
    libtpu_vmem_step_s: float  # the same with on-chip memory counted as libtpu's cost model counts it
    from_store: bool = False  # the compile was read back from planning/compile_store.py's store
    slices: int = 1  # slices joined by DCN (`v5e:16x16*2`); the program compiled is one slice's

    @property
    def total_bytes(self) -> int:
        # donated arguments alias outputs: count their buffers once
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.hbm_bytes

    def text(self) -> str:
        gib = lambda b: f"{b / 2**30:8.2f} GiB"  # noqa: E731
        lines = [
            f"AOT compile for {self.topology} ({self.devices} devices"
            f"{f' in {self.slices} slices' if self.slices > 1 else ''}"
            f"{'; read back from ' + STORE if self.from_store else ''}), per device:",
            f"  arguments   {gib(self.argument_bytes)}",
            f"  outputs     {gib(self.output_bytes)}  (of which {gib(self.alias_bytes).strip()} alias donated arguments)",
            f"  temporaries {gib(self.temp_bytes)}",
            f"  total       {gib(self.total_bytes)}  of {gib(self.hbm_bytes).strip()} HBM"
            f"  ({self.total_bytes / self.hbm_bytes:.0%})",
            f"  FLOPs/step  {self.model_flops_per_step:.3e} (6N + attention); XLA's cost analysis counts"
            f" {self.flops_per_step:.3e} (each scanned loop body once)",
        ]
        lines += ["  " + line for line in self.step_time.lines()]
        lines.append(f"  with VMEM counted as libtpu's cost model counts it (at the HBM rate, prefetches 4x, in"
                     f" series): {self.libtpu_vmem_step_s * 1e3:.1f} ms per step, the pessimistic end"
                     " (docs/aot_planning.md, On-chip memory)")
        if self.optimal_seconds > 0:
            lines.append(f"  libtpu's cost model: {self.optimal_seconds / self.steps_per_call * 1e3:.1f} ms per step")
        else:
            lines.append(f"  libtpu's cost model: none (optimal_seconds={self.optimal_seconds:.3g} for this program)")
        lines.append("  fits in HBM" if self.fits else "  DOES NOT FIT in HBM")
        return "\n".join(lines)


def chip_of(topology: str) -> tuple[str, Chip]:
    chip = topology.split(":")[0]
    if chip not in CHIPS:
        raise ConfigError(f"--topology {topology}: unknown TPU generation {chip!r}; known: {sorted(CHIPS)}")
    return chip, CHIPS[chip]


def parse_topology(topology: str) -> tuple[str, int]:
    """`v5e:16x16*2` -> ("v5e:16x16", 2): one slice's topology as libtpu names it, and the number of slices (DCN
    between them; 1 without `*N`)."""
    name, star, count = topology.partition("*")
    if not star:
        return name, 1
    if not count.isdigit() or int(count) < 1:
        raise ConfigError(f"--topology {topology}: the number of slices after '*' must be a positive integer, got {count!r}"
                          " (e.g. v5e:16x16*2)")
    return name, int(count)


def topology_devices(topology: str):
    chip, spec = chip_of(topology)
    name, slices = parse_topology(topology)
    # Describing a topology loads libtpu, which by default takes a machine-wide lock as if it owned the TPU. Here it
    # only compiles, so a second plan.py (or a test) on the same machine may load it too; on a TPU VM set
    # beside a running job, this still leaves the chips to the job (a description allocates nothing).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        topo = topologies.get_topology_desc(
            platform="tpu", topology_name=name, chip_config_name=spec.chip_config,
            chips_per_host_bounds=spec.host, num_slices=slices,
        )
    except Exception as e:  # libtpu missing, or a name it does not know
        hint = ("" if importlib.util.find_spec("libtpu") else "; install the `tpu` extra (pip install -e '.[tpu]')")
        raise ConfigError(f"--topology {topology}: cannot describe this topology ({str(e).splitlines()[0]}){hint}"
                          ) from None
    return topo.devices


def for_topology(cfg: Config, topology: str) -> Config:
    """`cfg` spanning the topology's slices (mesh.num_slices from `*N`; a different explicit value is an error)."""
    slices = parse_topology(topology)[1]
    if cfg.mesh.num_slices not in (1, slices):
        raise ConfigError(f"--topology {topology}: {slices} slice(s), but mesh.num_slices={cfg.mesh.num_slices}")
    return dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, num_slices=slices))


def compile_for_topology(cfg: Config, topology: str) -> AotReport:
    """Compiles the K-step train call for `topology` (or reads the same compile back from the store) and reports
    on it; allocates no arrays. A program the TPU compiler refuses because it cannot fit raises `DoesNotFit` with
    the compiler's numbers."""
    _, spec = chip_of(topology)
    slices = parse_topology(topology)[1]
    program, mesh = compile_train_call(cfg, topology)
    if program.error is not None:
        raise DoesNotFit(f"--topology {topology}: does not fit in HBM: {program.error}")
    # libtpu's `optimal_seconds` is a sum over the entry computation's ops (a loop body counted once) in which each
    # `ConcatBitcast` custom call counts -1 s: the op with which memory-space assignment's *sliced prefetch* glues
    # a buffer copied HBM->VMEM in pieces (slice-start/slice-done) back together. Our train call has 5 of them at
    # the top level: -5 + 3.6 ms = -4.996 for gpt2_124m on v5e:2x4. A one-step SGD update of a 512x512 float32
    # weight shows it alone: -0.99998 as compiled, +2.6e-5 s with compiler_options=
    # {"xla_tpu_sliced_prefetch_max_slices": 0} (no ConcatBitcast). Donation only matters as far as it changes
    # which buffers get sliced prefetches. With that flag the gpt2_124m call gets +0.038 s, but for 10 steps of
    # 16 micro-batches of 12 layers each counted once: no step time either. Hence planning/step_time.py.
    t = cfg.train
    tokens_per_chip = t.batch_size * t.seq_len / mesh.size  # per step
    model_flops = cfg.model.flops_per_token(t.seq_len) * tokens_per_chip
    causal_flops = cfg.model.flops_per_token(t.seq_len, causal=True) * tokens_per_chip
    return AotReport(
        topology=topology, devices=mesh.size,
        argument_bytes=program.argument_bytes, output_bytes=program.output_bytes,
        temp_bytes=program.temp_bytes, alias_bytes=program.alias_bytes, hbm_bytes=spec.hbm_bytes,
        flops_per_step=program.flops, model_flops_per_step=model_flops,
        optimal_seconds=program.optimal_seconds, steps_per_call=t.steps_per_call,
        step_time=estimate_hlo(program.hlo, spec, dict(mesh.shape), steps_per_call=t.steps_per_call,
                               model_flops_per_step=model_flops, causal_model_flops_per_step=causal_flops,
                               slices=slices),
        libtpu_vmem_step_s=estimate_hlo(program.hlo, spec, dict(mesh.shape), steps_per_call=t.steps_per_call,
                                        libtpu_vmem=True, slices=slices).predicted_s,
        from_store=program.from_store, slices=slices,
    )


def compile_train_call(cfg: Config, topology: str) -> tuple[CompiledProgram, Mesh]:
    """(the train call compiled for `topology`, its mesh)."""
    cfg = for_topology(cfg, topology)
    mesh = build_mesh(cfg, devices=topology_devices(topology))
    trainer = TrainProgram.build(cfg, mesh)
    with jax.set_mesh(mesh):
        return compile_lowered(trainer.lower(), topology), mesh


class DoesNotFit(ConfigError):
    """The TPU compiler's refusal of a program larger than HBM; `required_bytes` as it states them."""

    @property
    def required_bytes(self) -> float | None:
        m = re.search(r"required for [^(]*\(([0-9.]+)([KMGT])\)", str(self))
        return float(m.group(1)) * 2 ** (10 * " KMGT".index(m.group(2))) if m else None


def run_aot(cfg: Config, topology: str) -> int:
    report = compile_for_topology(cfg, topology)
    print(report.text())
    if not report.fits:
        raise ConfigError(
            f"--topology {topology}: the train call needs {report.total_bytes / 2**30:.2f} GiB per device but a chip"
            f" has {report.hbm_bytes / 2**30:.0f} GiB HBM; shard more (mesh.fsdp), shrink train.batch_size,"
            " or set model.remat"
        )
    return 0
