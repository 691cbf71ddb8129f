"""Start-up shared by train.py and eval.py: processes, mesh, corpus, data pipelines."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import jax
from jax.sharding import Mesh

from configs.base import Config
from data.loader import Corpus, LoaderConfig, make_dataset, open_corpus
from data.prepare import prepare_shakespeare
from gpt2.config import ConfigError
from gpt2.sharding import make_mesh

EMBEDDED = "shakespeare"


def initialize_distributed(cfg: Config) -> None:
    """Joins the multi-process job when there is one: explicit settings, JAX_* variables, or a TPU VM."""
    d = cfg.distributed
    address = d.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if address is not None:
        num = d.num_processes if d.num_processes is not None else int(os.environ["JAX_NUM_PROCESSES"])
        pid = d.process_id if d.process_id is not None else int(os.environ["JAX_PROCESS_ID"])
        if os.environ.get("JAX_PLATFORMS", "") == "cpu" or jax.config.jax_platforms == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=address, num_processes=num, process_id=pid,
                                   heartbeat_timeout_seconds=d.heartbeat_timeout_seconds,
                                   initialization_timeout=d.initialization_timeout)
    elif _on_tpu_vm():
        # auto-detects the pod's hosts from the TPU metadata
        jax.distributed.initialize(heartbeat_timeout_seconds=d.heartbeat_timeout_seconds,
                                   initialization_timeout=d.initialization_timeout)


def _on_tpu_vm() -> bool:
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")) and _has_libtpu()


def _has_libtpu() -> bool:
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None


def build_mesh(cfg: Config, devices=None) -> Mesh:
    """The configured mesh, checked against the devices and the global batch."""
    m = cfg.mesh
    mesh = make_mesh(m.data, m.fsdp, m.tensor, devices=devices)
    batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    t = cfg.train
    micro = t.batch_size // t.grad_accum
    if micro % batch_shards:
        raise ConfigError(
            f"train.batch_size={t.batch_size} / train.grad_accum={t.grad_accum} = {micro} rows per micro-batch"
            f" is not divisible by the data-parallel size mesh.data×mesh.fsdp = {batch_shards}"
        )
    if t.batch_size % jax.process_count():
        raise ConfigError(
            f"train.batch_size={t.batch_size} is not divisible by the {jax.process_count()} processes"
        )
    return mesh


def resolve_corpus(cfg: Config, *, prepare: bool = True) -> Corpus:
    """The configured corpus, validated; the embedded one is tokenized on first use."""
    dataset = cfg.data.dataset
    if dataset == EMBEDDED:
        directory = Path(cfg.data.cache_dir).expanduser()
        if prepare and jax.process_index() == 0:
            prepare_shakespeare(directory, quiet=(directory / "meta.json").exists())
        _barrier("corpus")
    else:
        directory = Path(dataset).expanduser()
    return open_corpus(directory, vocab_size=cfg.model.vocab_size, min_tokens=cfg.train.seq_len + 1)


def train_loader_config(cfg: Config) -> LoaderConfig:
    t = cfg.train
    return LoaderConfig(
        seq_len=t.seq_len, batch_size=t.batch_size // jax.process_count(),
        steps_per_call=t.steps_per_call, seed=cfg.data.seed, num_workers=cfg.data.num_workers,
        prefetch=cfg.data.prefetch,
    )


def val_dataset(cfg: Config, corpus: Corpus, batch_size: int, num_epochs: int | None = None):
    """Validation batches [1, B_local, T+1] in file order: every evaluation sees the same ones.
    num_epochs=None repeats the split (training's fixed-size evaluations); 1 ends after it (eval.py)."""
    loader = LoaderConfig(
        seq_len=cfg.train.seq_len, batch_size=batch_size // jax.process_count(), shuffle=False,
        num_epochs=num_epochs, prefetch=cfg.data.prefetch,
    )
    return make_dataset(corpus.files("val"), cfg.model.vocab_size, loader)


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
