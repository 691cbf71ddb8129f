"""Ahead-of-time compilation of the real train call for a TPU topology, on a machine without TPUs.

`python plan.py --config gpt2_xl_pod --topology v5e:16x16` lowers and compiles exactly what a pod would run
(model, sharding rules, optimizer, K-step scan, batch) against libtpu's description of the topology, with
abstract arrays only, and reports per-device memory against the chip's HBM and a step-time estimate read from the
compiled program (planning/step_time.py).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import re
import time

import jax
from jax.experimental import topologies
from jax.sharding import Mesh

from configs.base import Config
from errors import ConfigError, first_line
from planning import compile_time
from planning.aot_report import AotReport, compile_line
from planning.chips import CHIPS, Chip
from planning.compile_store import CompiledProgram, compile_lowered, stored_path
from planning.step_time import estimate_hlo, torus
from trainer import libtpu_env
from trainer.program.mesh import build_mesh
from trainer.program.train_program import TrainProgram


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
        raise ConfigError(f"--topology {topology}: the number of slices after '*' must be a positive integer, "
                          f"got {count!r} (e.g. v5e:16x16*2)")
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
            chips_per_host_bounds=host_bounds(name, spec.host), num_slices=slices,
        )
    except Exception as e:  # libtpu missing, or a name it does not know
        hint = ("" if importlib.util.find_spec("libtpu") else "; install the `tpu` extra (pip install -e '.[tpu]')")
        raise ConfigError(f"--topology {topology}: cannot describe this topology ({first_line(e)}){hint}") from None
    return topo.devices


def host_bounds(name: str, host: tuple[int, int, int]) -> tuple[int, int, int]:
    """The chips one host holds, as libtpu's `chips_per_host_bounds` for the slice `name` (v5e:2x4): the
    generation's host (`host`, 2x2x1) cut down to what divides each of the slice's dimensions, so that a slice
    smaller than one host is one host of its own (v5e:1x1 and v6e:1x1 -> 1x1x1, as a v5litepod-1 / v6e-1 is;
    v5e:1x2 -> 1x2x1); every other slice keeps 2x2x1.

    libtpu refuses bounds that do not divide the slice ("not divisible by ... chips_per_host_bounds"); otherwise
    they only say which chips share a process. The compiled program does not depend on them: a sharded matmul for
    v5e:2x4 under 2x2x1, 2x4x1 (a v5litepod-8's one host of 8) and 1x1x1 gave the same mesh and the same HLO."""
    dims = name.partition(":")[2].split("x")
    if not all(d.isdigit() for d in dims) or len(dims) > len(host):
        return host  # not a shape: libtpu's own message names what is wrong with it
    dims = [int(d) for d in dims] + [1] * (len(host) - len(dims))  # v5e:2x4 is 2x4x1
    return tuple(math.gcd(d, h) for d, h in zip(dims, host))


def for_topology(cfg: Config, topology: str) -> Config:
    """`cfg` spanning the topology's slices (mesh.num_slices from `*N`; a different explicit value is an error)."""
    slices = parse_topology(topology)[1]
    if cfg.mesh.num_slices not in (1, slices):
        raise ConfigError(f"--topology {topology}: {slices} slice(s), but mesh.num_slices={cfg.mesh.num_slices}")
    return dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, num_slices=slices))


def compile_for_topology(cfg: Config, topology: str, preset: str = "",
                         lowered: LoweredCall | None = None) -> AotReport:
    """Compiles the K-step train call for `topology` (or reads the same compile back from the store) and reports
    on it; allocates no arrays. `lowered`: the call already lowered by `lower_train_call(cfg, topology)`. A program
    the TPU compiler refuses because it cannot fit raises `DoesNotFit` with the compiler's numbers."""
    _, spec = chip_of(topology)
    slices = parse_topology(topology)[1]
    lowered = lowered or lower_train_call(cfg, topology)
    program, mesh = lowered.compile(), lowered.mesh
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
                               slices=slices, torus=torus(mesh)),
        libtpu_vmem_step_s=estimate_hlo(program.hlo, spec, dict(mesh.shape), steps_per_call=t.steps_per_call,
                                        libtpu_vmem=True, slices=slices, torus=torus(mesh)).predicted_s,
        from_store=program.from_store, slices=slices, tokens_per_step=t.batch_size * t.seq_len, preset=preset,
    )


def topology_mesh(cfg: Config, topology: str) -> tuple[Config, Mesh]:
    """`cfg` spanning the topology's slices, and its mesh over the topology's devices."""
    cfg = for_topology(cfg, topology)
    return cfg, build_mesh(cfg, devices=topology_devices(topology))


@dataclasses.dataclass(frozen=True)
class LoweredCall:
    """The train call lowered for a topology, not yet compiled: whether the store has its compile, and how long
    compiling it may take here (planning/compile_time.py)."""

    lowered: jax.stages.Lowered
    mesh: Mesh
    topology: str
    options: dict[str, str]  # the libtpu flags of the compile
    tokens_per_chip: float  # one micro-batch's: with the program's size, what a compile's time grows with

    @functools.cached_property
    def text(self) -> str:
        return self.lowered.as_text()

    @property
    def stored(self) -> bool:
        return stored_path(self.lowered, self.topology, self.options, self.text).exists()

    def expected(self) -> tuple[float, str]:
        """(seconds its compile may take here, what that is based on)."""
        return compile_time.estimate(len(self.text), self.tokens_per_chip)

    def compile(self) -> CompiledProgram:
        start = time.monotonic()
        with jax.set_mesh(self.mesh):
            program = compile_lowered(self.lowered, self.topology, self.options, self.text)
        if not program.from_store and program.error is None:  # a refusal ends early: no measure of a compile
            compile_time.record(len(self.text), self.tokens_per_chip, time.monotonic() - start)
        return program


def lower_train_call(cfg: Config, topology: str) -> LoweredCall:
    """The train call lowered for `topology`, with the flags train.py sets on that TPU."""
    cfg, mesh = topology_mesh(cfg, topology)
    trainer = TrainProgram.build(cfg, mesh)
    t = cfg.train
    tokens = t.batch_size // t.grad_accum * t.seq_len / (mesh.shape["data"] * mesh.shape["fsdp"])
    with jax.set_mesh(mesh):
        lowered = trainer.lower()
    return LoweredCall(lowered, mesh, topology, libtpu_env.compile_options(chip_of(topology)[0]), tokens)


def compile_train_call(cfg: Config, topology: str) -> tuple[CompiledProgram, Mesh]:
    """(the train call compiled for `topology` with the flags train.py sets on that TPU, its mesh)."""
    lowered = lower_train_call(cfg, topology)
    return lowered.compile(), lowered.mesh


class DoesNotFit(ConfigError):
    """The TPU compiler's refusal of a program larger than HBM; `required_bytes` as it states them."""

    @property
    def required_bytes(self) -> float | None:
        m = re.search(r"required for [^(]*\(([0-9.]+)([KMGT])\)", str(self))
        return float(m.group(1)) * 2 ** (10 * " KMGT".index(m.group(2))) if m else None


def run_aot(cfg: Config, topology: str, preset: str = "the config", verbose: bool = False) -> int:
    """`plan.py --topology T`: says what it compiles and how long that may take, compiles, prints the verdict and
    the breakdown."""
    chip_of(topology)  # an unknown generation is one line, before libtpu loads
    lowered = lower_train_call(cfg, topology)
    t = cfg.train
    print(compile_line(preset, topology, dict(lowered.mesh.shape), t.batch_size, t.seq_len, t.grad_accum,
                       t.steps_per_call, None if lowered.stored else lowered.expected()), flush=True)
    report = compile_for_topology(cfg, topology, preset, lowered)
    print(report.text(verbose))
    if not report.fits:
        raise ConfigError(
            f"--topology {topology}: the train call needs {report.total_bytes / 2**30:.2f} GiB per device but a chip"
            f" has {report.hbm_bytes / 2**30:.0f} GiB HBM; shard more (mesh.fsdp), shrink train.batch_size,"
            " or set model.remat"
        )
    return 0
