"""Python's start-up in the processes the tests start (tests/conftest.py puts this directory on the PYTHONPATH they
inherit; a fake host of tests/support/cloud.py has nothing else on its own; the documentation's commands run with
the checkout's alone, as a user's). Each change waits for the JAX module it touches to be imported (a process
that does not import JAX pays nothing).

Every process writes its compilations to the session's compilation cache: JAX writes only from process 0, and on
CPU each process of a job keys a program by its own devices, so process 1 never found what process 0 had written
and compiled every program cold (docs/testing.md has the measurements). A cache-only change: no program or
number differs.

FAKE_TPU_VM: JAX's import (cloud_tpu_init) finds no TPU chips here and so sets TPU_SKIP_MDS_QUERY, which keeps its
Cloud TPU cluster detection off the metadata server; a TPU VM has chips and does not set it. (JAX_FORCE_TPU_INIT,
which the fake sets, makes JAX treat the machine as a Cloud TPU VM otherwise.)

FAKE_GPU_NODE: `jax.distributed.initialize` restricts a GPU process to `local_device_ids` through
jax_cuda_visible_devices (on Slurm, by default, to the one GPU SLURM_LOCALID names); a CPU backend ignores it. Here
the node's GPUs are CPU devices, so the same restriction is applied to their number, as CUDA would apply it.
"""

import importlib.abc
import importlib.util
import os
import sys
import time
import warnings


class _After(importlib.abc.MetaPathFinder):
    """Calls `then(module)` once module `name` has run, before whoever imports it sees it."""

    def __init__(self, name, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            self.then(module)

        spec.loader.exec_module = exec_module
        return spec


def _metadata_server_stays_reachable(cloud_tpu_init):
    init = cloud_tpu_init.cloud_tpu_init

    def cloud_tpu_init_on_a_tpu_vm():
        init()
        os.environ.pop("TPU_SKIP_MDS_QUERY", None)

    cloud_tpu_init.cloud_tpu_init = cloud_tpu_init_on_a_tpu_vm


def _visible_devices_only(distributed):
    initialize = distributed.State.initialize

    def initialize_seeing_the_visible_devices(self, *args, **kwargs):
        initialize(self, *args, **kwargs)
        import jax
        from jax._src import xla_bridge

        visible = xla_bridge.CUDA_VISIBLE_DEVICES.value
        if visible != "all":
            jax.config.update("jax_num_cpu_devices", len(visible.split(",")))

    distributed.State.initialize = initialize_seeing_the_visible_devices


def _every_process_writes_the_cache(compiler):
    from jax._src import compilation_cache, config, distributed

    compile_and_write = compiler._compile_and_write_cache

    def compile_and_write_from_any_process(backend, computation, executable_devices, compile_options,
                                           host_callbacks, module_name, cache_key):
        start = time.monotonic()
        executable = compile_and_write(backend, computation, executable_devices, compile_options, host_callbacks,
                                       module_name, cache_key)
        took = time.monotonic() - start
        # process 0's is written already; the rest of JAX's own rule for a write (compiler._cache_write)
        if (distributed.global_state.process_id != 0 and not host_callbacks
                and took >= config.persistent_cache_min_compile_time_secs.value):
            try:
                compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend, int(took))
            except Exception as e:  # as JAX's own write: said, and the program runs
                warnings.warn(f"Error writing persistent compilation cache entry for '{module_name}':"
                              f" {type(e).__name__}: {e}")
        return executable

    compiler._compile_and_write_cache = compile_and_write_from_any_process


sys.meta_path.insert(0, _After("jax._src.compiler", _every_process_writes_the_cache))
if os.environ.get("FAKE_TPU_VM"):
    sys.meta_path.insert(0, _After("jax._src.cloud_tpu_init", _metadata_server_stays_reachable))
if os.environ.get("FAKE_GPU_NODE"):
    sys.meta_path.insert(0, _After("jax._src.distributed", _visible_devices_only))
