"""The run's device mesh, checked against the devices and the global batch before anything is built."""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from configs.base import Config, MeshConfig
from errors import ConfigError
from gpt2.sharding import make_mesh


def build_mesh(cfg: Config, devices=None) -> Mesh:
    """The configured mesh, checked against the devices and the global batch."""
    m, t = cfg.mesh, cfg.train
    return checked_mesh(m, t.batch_size // t.grad_accum, devices=devices,
                        batch_flag=f"train.batch_size={t.batch_size} / train.grad_accum={t.grad_accum}")


def checked_mesh(m: MeshConfig, rows: int, *, batch_flag: str, devices=None) -> Mesh:
    """A mesh whose data-parallel size divides `rows` (one micro-batch), as does the process count."""
    mesh = make_mesh(m.data, m.fsdp, m.tensor, devices=devices)
    batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if rows % batch_shards:
        raise ConfigError(f"{batch_flag} = {rows} rows per batch is not divisible by the data-parallel size"
                          f" mesh.data×mesh.fsdp = {batch_shards}")
    if rows % jax.process_count():
        raise ConfigError(f"{batch_flag} = {rows} rows is not divisible by the {jax.process_count()} processes")
    return mesh
