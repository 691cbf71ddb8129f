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


# "auto" for a run directory on this machine: one cache for all of this user's runs, so that a new run of programs
# an earlier run compiled (another run directory, eval.py on its checkpoints) starts warm.
SHARED = "~/.cache/gpt2_nnx/compile_cache"


def use_compile_cache(setting: str, run_dir, size_gb: float) -> str | None:  # run_dir: a RunDir
    """Points JAX's persistent cache at `SHARED` ("auto" with a local run directory), the run's `compile_cache/`
    ("auto" on gs://: the one place every host of a pod sees), a given directory, or nowhere ("off"); returns the
    directory. With "auto", a JAX_COMPILATION_CACHE_DIR in the environment wins, and JAX's own settings (from the
    environment) are left as they are."""
    if setting == "off":
        return None
    if setting == "auto" and os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    if setting == "auto":
        directory = str(run_dir / CACHE) if run_dir.remote else os.path.expanduser(SHARED)
    else:
        directory = setting
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_compilation_cache_max_size", int(size_gb * 2**30))
    # JAX's default caches programs that took >= 1 s to compile; the evaluation's loss call takes ~0.8 s on a
    # CPU and a restart should load it too. Tinier programs (slicing, casts) stay uncached: reading them back
    # costs about what compiling them does.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return directory
