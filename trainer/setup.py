"""Start-up shared by train.py and eval.py: processes, mesh, corpus, data pipelines."""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile
from pathlib import Path
from typing import Iterator

import jax
from jax.sharding import Mesh

from configs.base import Config, DataConfig, DistributedConfig, MeshConfig
from data.loader import Corpus, LoaderConfig, make_dataset, open_corpus
from data.prepare import prepare_shakespeare
from configs.errors import ConfigError
from gpt2.sharding import make_mesh
from trainer.run_dir import append, is_remote, oserror_reason, warn

EMBEDDED = "shakespeare"


def initialize_distributed(d: DistributedConfig) -> None:
    """Joins the multi-process job when there is one: explicit settings (flags, then JAX_* variables) override
    JAX's own cluster detection (Cloud TPU VMs and GKE, SLURM, Open MPI, Kubernetes); none of them: one
    process."""
    address = d.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    timeouts = dict(heartbeat_timeout_seconds=d.heartbeat_timeout_seconds,
                    initialization_timeout=d.initialization_timeout)
    if address is not None:
        num = _setting("distributed.num_processes", d.num_processes, "JAX_NUM_PROCESSES")
        pid = _setting("distributed.process_id", d.process_id, "JAX_PROCESS_ID")
        if os.environ.get("JAX_PLATFORMS", "") == "cpu" or jax.config.jax_platforms == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=address, num_processes=num, process_id=pid, **timeouts)
    elif _cluster_detected():
        jax.distributed.initialize(num_processes=d.num_processes, process_id=d.process_id, **timeouts)


def _setting(flag: str, value: int | None, variable: str) -> int:
    if value is not None:
        return value
    try:
        return int(os.environ[variable])
    except (KeyError, ValueError):
        raise ConfigError(f"a coordinator address is set, so --{flag} (or {variable}) must be an integer too"
                          ) from None


def _cluster_detected() -> bool:
    """Whether one of the cluster environments `jax.distributed.initialize()` knows is present (JAX keeps its
    list private; without it, only a Cloud TPU VM is recognised)."""
    try:
        from jax._src.clusters import ClusterEnv

        return any(not env.opt_in_only_method and env.is_env_present() for env in ClusterEnv._cluster_types)
    except (ImportError, AttributeError):
        return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


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


def resolve_corpus(data: DataConfig, *, vocab_size: int, seq_len: int, prepare: bool = True) -> Corpus:
    """The configured corpus, validated; the embedded one is tokenized on first use."""
    if is_remote(data.dataset):
        raise ConfigError(f"data.dataset={data.dataset!r}: token files are read from a local or mounted directory"
                          " (memory-mapped, random access); mount the bucket with gcsfuse and pass the mount's path"
                          " (README, Training on a TPU pod)")
    if data.dataset == EMBEDDED:
        directory = Path(data.cache_dir).expanduser()
        if prepare and jax.process_index() == 0:
            prepare_shakespeare(directory, quiet=(directory / "meta.json").exists())
        barrier("corpus")
    else:
        directory = Path(data.dataset).expanduser()
    return open_corpus(directory, vocab_size=vocab_size, min_tokens=seq_len + 1)


def train_loader_config(cfg: Config) -> LoaderConfig:
    t = cfg.train
    return LoaderConfig(
        seq_len=t.seq_len, batch_size=t.batch_size // jax.process_count(), seed=cfg.data.seed,
        num_workers=cfg.data.num_workers, prefetch=cfg.data.prefetch,
    )


def val_dataset(corpus: Corpus, *, vocab_size: int, seq_len: int, batch_size: int,
                num_epochs: int | None = None, prefetch: int = 2):
    """Validation batches [B_local, T+1] in file order: every evaluation sees the same ones.
    num_epochs=None repeats the split (training's fixed-size evaluations); 1 ends after it (eval.py)."""
    loader = LoaderConfig(seq_len=seq_len, batch_size=batch_size // jax.process_count(), shuffle=False,
                          num_epochs=num_epochs, prefetch=prefetch)
    return make_dataset(corpus.files("val"), vocab_size, loader)


@contextlib.contextmanager
def library_logs_to(directory) -> Iterator[None]:
    """Sends library log records (absl / Python logging: Orbax, Grain, JAX, gcsfs) to
    <directory>/process_<i>.log instead of the console, where a failing background write would print hundreds
    of lines before the one line that says what happened. A log that cannot be written (full disk) is dropped
    silently. On cloud storage the records go to a local temporary file that is appended to the log object
    at exit (a process killed with -9 leaves it in the temporary directory instead)."""
    import logging

    from absl import logging as absl_logging

    name = f"process_{jax.process_index()}.log"
    local, failing = None, False
    try:
        if is_remote(directory):
            local = os.path.join(tempfile.gettempdir(), f"gpt2-nnx-{os.getpid()}-{name}")  # made at the first record
            handler = logging.FileHandler(local, delay=True)
        else:
            directory.mkdir(exist_ok=True)  # inside an existing run directory only
            handler = logging.FileHandler(str(directory / name), delay=True)
    except OSError:
        handler = logging.NullHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root, absl_handler = logging.getLogger(), absl_logging.get_absl_handler()
    saved = (list(root.handlers), absl_handler.level, logging.raiseExceptions)
    for h in saved[0]:
        root.removeHandler(h)
    root.addHandler(handler)
    absl_handler.setLevel(logging.CRITICAL + 1)  # absl's own stderr handler
    logging.raiseExceptions = False  # a full disk must not print "--- Logging error ---" blocks
    try:
        yield
    except BaseException:
        # Failing: background threads (Orbax's writers) may still log their side of it; they must not reach
        # the console either, so the console handlers stay detached.
        root.addHandler(logging.NullHandler())
        failing = True
        raise
    else:
        for h in saved[0]:
            root.addHandler(h)
        absl_handler.setLevel(saved[1])
        logging.raiseExceptions = saved[2]
    finally:
        root.removeHandler(handler)
        with contextlib.suppress(OSError):
            handler.close()
        if local is not None:
            _upload_log(local, directory / name, quiet=failing)


def _upload_log(local: str, target, *, quiet: bool) -> None:
    """Appends a local log file to its object and removes it; a log that cannot be uploaded stays local (said
    in a warning, unless the run is failing: then its own error is the one line to print)."""
    try:
        if os.path.exists(local):
            append(target, Path(local).read_bytes())
            os.remove(local)
    except Exception as e:  # noqa: BLE001 - a storage error here must not replace the run's own outcome
        if not quiet:
            warn(f"library logs not uploaded to {target} ({oserror_reason(e)}); they are in {local}")


def barrier(name: str) -> None:
    """Waits for every process (a no-op with one)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
