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
from errors import ConfigError, first_line
from planning.aot_report import AotReport, compile_line
from planning.chips import CHIPS, Chip
from planning.compile_store import CompiledProgram, compile_lowered
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
            chips_per_host_bounds=spec.host, num_slices=slices,
        )
    except Exception as e:  # libtpu missing, or a name it does not know
        hint = ("" if importlib.util.find_spec("libtpu") else "; install the `tpu` extra (pip install -e '.[tpu]')")
        raise ConfigError(f"--topology {topology}: cannot describe this topology ({first_line(e)}){hint}") from None
    return topo.devices


def for_topology(cfg: Config, topology: str) -> Config:
    """`cfg` spanning the topology's slices (mesh.num_slices from `*N`; a different explicit value is an error)."""
    slices = parse_topology(topology)[1]
    if cfg.mesh.num_slices not in (1, slices):
        raise ConfigError(f"--topology {topology}: {slices} slice(s), but mesh.num_slices={cfg.mesh.num_slices}")
    return dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, num_slices=slices))


def compile_for_topology(cfg: Config, topology: str, preset: str = "") -> AotReport:
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
                               slices=slices, torus=torus(mesh)),
        libtpu_vmem_step_s=estimate_hlo(program.hlo, spec, dict(mesh.shape), steps_per_call=t.steps_per_call,
                                        libtpu_vmem=True, slices=slices, torus=torus(mesh)).predicted_s,
        from_store=program.from_store, slices=slices, tokens_per_step=t.batch_size * t.seq_len, preset=preset,
    )


def topology_mesh(cfg: Config, topology: str) -> tuple[Config, Mesh]:
    """`cfg` spanning the topology's slices, and its mesh over the topology's devices."""
    cfg = for_topology(cfg, topology)
    return cfg, build_mesh(cfg, devices=topology_devices(topology))


def compile_train_call(cfg: Config, topology: str) -> tuple[CompiledProgram, Mesh]:
    """(the train call compiled for `topology` with the flags train.py sets on that TPU, its mesh)."""
    cfg, mesh = topology_mesh(cfg, topology)
    trainer = TrainProgram.build(cfg, mesh)
    options = libtpu_env.compile_options(chip_of(topology)[0])
    with jax.set_mesh(mesh):
        return compile_lowered(trainer.lower(), topology, options), mesh


class DoesNotFit(ConfigError):
    """The TPU compiler's refusal of a program larger than HBM; `required_bytes` as it states them."""

    @property
    def required_bytes(self) -> float | None:
        m = re.search(r"required for [^(]*\(([0-9.]+)([KMGT])\)", str(self))
        return float(m.group(1)) * 2 ** (10 * " KMGT".index(m.group(2))) if m else None


def run_aot(cfg: Config, topology: str, preset: str = "the config", verbose: bool = False) -> int:
    """`plan.py --topology T`: says what it compiles, compiles, prints the verdict and the breakdown."""
    chip_of(topology)  # an unknown generation is one line, before libtpu loads
    described, mesh = topology_mesh(cfg, topology)
    t = described.train
    print(compile_line(preset, topology, dict(mesh.shape), t.batch_size, t.seq_len, t.grad_accum, t.steps_per_call),
          flush=True)
    report = compile_for_topology(cfg, topology, preset)
    print(report.text(verbose))
    if not report.fits:
        raise ConfigError(
            f"--topology {topology}: the train call needs {report.total_bytes / 2**30:.2f} GiB per device but a chip"
            f" has {report.hbm_bytes / 2**30:.0f} GiB HBM; shard more (mesh.fsdp), shrink train.batch_size,"
            " or set model.remat"
        )
    return 0
