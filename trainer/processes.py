"""The job's processes: joining a multi-process job, and every act that needs all of them to agree.

A pod runs one program per host. Whatever one process decides alone (it could not take the run directory, a
checkpoint does not restore on it) must become the job's decision, or the others wait forever in their next
collective. Every such agreement goes through here; with one process each is a no-op.
"""

from __future__ import annotations

import glob
import os
from typing import Callable, TypeVar

import jax
import numpy as np

from configs.base import DistributedConfig
from errors import ConfigError, UserError

T = TypeVar("T")


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


def is_process_0() -> bool:
    """The process that writes the run's shared files and prints to the console."""
    return jax.process_index() == 0


def say(text: str) -> None:
    """Prints once per job (on process 0)."""
    if is_process_0():
        print(text, flush=True)


def barrier(name: str) -> None:
    """Waits for every process."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def all_agree(ok: bool) -> bool:
    """True only when `ok` is true on every process."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.array(ok))))


def on_process_0(act: Callable[[], T], what: str) -> T | None:
    """Runs `act` on process 0 only; if it raises a UserError, every process raises one (process 0 its own, the
    others one naming `what` process 0 could not do), so no process is left waiting for the others."""
    failure, result = None, None
    if is_process_0():
        try:
            result = act()
        except UserError as e:
            failure = e
    if not all_agree(failure is None):
        raise failure or UserError(f"process 0 could not {what}; its error is on its console")
    return result
