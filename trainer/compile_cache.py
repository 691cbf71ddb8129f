"""JAX's persistent compilation cache for a run: a restart (after a preemption, a crash, a stop_after) loads the
compiled train call, evaluation and lm-eval programs from it instead of compiling them again.

JAX keys each entry by the program, the devices and the compiler version, writes entries atomically and evicts
the least recently used past a size bound, so every process of a job and several jobs may share one directory
(local or gs://, through etils.epath).
"""

from __future__ import annotations

import os

import jax

CACHE = "compile_cache"


def use_compile_cache(setting: str, run_dir, size_gb: float) -> str | None:
    """Points JAX's persistent cache at the run's `compile_cache/` ("auto"), a given directory, or nowhere
    ("off"); returns the directory. JAX_COMPILATION_CACHE_DIR in the environment wins over "auto"."""
    if setting == "off":
        return None
    if setting == "auto":
        directory = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(run_dir / CACHE)
    else:
        directory = setting
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_compilation_cache_max_size", int(size_gb * 2**30))
    return directory
