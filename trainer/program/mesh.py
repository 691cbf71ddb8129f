"""The device mesh: its construction from sizes (one may be -1, "the rest"), and the run's mesh, checked against the
devices and the global batch before anything is built.

Over several TPU slices (`mesh.num_slices`) the mesh keeps its three axes: `data` spans the slices, slice-major (data
index = slice × data-per-slice + the index inside the slice), while `fsdp` and `tensor` stay inside a slice, so that
only the data-parallel gradient reduction crosses the slower data-center network (DCN). Parameters, batches and
checkpoints mean what they mean on one slice of as many devices.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from configs.base import Config, MeshConfig
from errors import ConfigError
from gpt2.sharding import MESH_AXES


def make_mesh(
    data: int = -1, fsdp: int = 1, tensor: int = 1, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A ('data', 'fsdp', 'tensor') mesh over `devices` (default: all). One size may be -1 ("the rest")."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(data, fsdp, tensor, len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def mesh_shape(data: int, fsdp: int, tensor: int, devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) sizes over `devices` devices, the one -1 resolved to the devices the others leave."""
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}  # each >= 1 or -1 (MeshConfig checks them)
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ConfigError(f"only one mesh axis may be -1, got {free}")
    fixed = int(np.prod([s for s in sizes.values() if s != -1]))
    if free:
        if devices % fixed:
            raise ConfigError(
                f"mesh {sizes}: {devices} devices are not divisible by the fixed axes' product {fixed}"
            )
        sizes[free[0]] = devices // fixed
    if int(np.prod(list(sizes.values()))) != devices:
        raise ConfigError(
            f"mesh data×fsdp×tensor = {sizes['data']}×{sizes['fsdp']}×{sizes['tensor']} ="
            f" {int(np.prod(list(sizes.values())))} but there are {devices} devices"
        )
    return tuple(sizes[a] for a in MESH_AXES)


def build_mesh(cfg: Config, devices=None) -> Mesh:
    """The configured mesh, checked against the devices and the global batch."""
    m, t = cfg.mesh, cfg.train
    return checked_mesh(m, t.batch_size // t.grad_accum, devices=devices,
                        batch_flag=f"train.batch_size={t.batch_size} / train.grad_accum={t.grad_accum}")


def checked_mesh(m: MeshConfig, rows: int, *, batch_flag: str, devices=None) -> Mesh:
    """A mesh whose data-parallel size divides `rows` (one micro-batch), as does the process count."""
    devices = list(jax.devices() if devices is None else devices)
    mesh = multislice_mesh(m, devices) if m.num_slices > 1 else make_mesh(m.data, m.fsdp, m.tensor, devices=devices)
    batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if rows % batch_shards:
        raise ConfigError(f"{batch_flag} = {rows} rows per batch is not divisible by the data-parallel size"
                          f" mesh.data×mesh.fsdp = {batch_shards}")
    if rows % jax.process_count():
        raise ConfigError(f"{batch_flag} = {rows} rows is not divisible by the {jax.process_count()} processes")
    return mesh


def multislice_mesh(m: MeshConfig, devices: list) -> Mesh:
    """The mesh over `m.num_slices` slices: each slice a (data / slices, fsdp, tensor) mesh of its own devices (laid
    out on its ICI torus), the slices stacked along `data`."""
    n = m.num_slices
    if len(devices) % n:
        raise ConfigError(f"mesh.num_slices={n}: the {len(devices)} devices do not divide into {n} slices")
    data, fsdp, tensor = mesh_shape(m.data, m.fsdp, m.tensor, len(devices))
    if data % n:
        raise ConfigError(f"mesh.num_slices={n}: mesh.data={data} is not a multiple of it; data parallelism spans"
                          " the slices, fsdp and tensor stay inside one (lower mesh.fsdp or mesh.tensor)")
    groups = slices_of(devices, n)
    inner, outer = (data // n, fsdp, tensor), (n, 1, 1)
    if devices[0].platform != "cpu":  # TPU: JAX's hybrid mesh, which groups by slice_index itself
        grid = mesh_utils.create_hybrid_device_mesh(inner, outer, devices, allow_split_physical_axes=True)
    else:  # the same construction over our process groups: one mesh per slice, stacked along the DCN axis
        grid = np.concatenate([mesh_utils.create_device_mesh(inner, g, allow_split_physical_axes=True)
                               for g in groups])
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def slices_of(devices: list, n: int) -> list[list]:
    """`devices` grouped into `n` equal slices, in slice order: by `slice_index` on TPUs, by process on CPUs (whose
    devices are all in slice 0): process p of P is in slice p // (P / n), as consecutive hosts of a multislice job
    form one slice."""
    groups = defaultdict(list)
    if devices[0].platform != "cpu":
        for d in devices:
            groups[getattr(d, "slice_index", 0)].append(d)
    else:
        processes = sorted({d.process_index for d in devices})
        if len(processes) % n:
            raise ConfigError(f"mesh.num_slices={n}: the {len(processes)} processes do not divide into {n} slices"
                              " (CPU devices are grouped into slices by process)")
        slice_of = {p: i // (len(processes) // n) for i, p in enumerate(processes)}
        for d in devices:
            groups[slice_of[d.process_index]].append(d)
    sizes = [len(groups[k]) for k in sorted(groups)]
    if len(sizes) != n or len(set(sizes)) != 1:
        raise ConfigError(f"mesh.num_slices={n}: the devices are in {len(sizes)} slices of {sizes} devices;"
                          f" expected {n} equal slices")
    return [groups[k] for k in sorted(groups)]
