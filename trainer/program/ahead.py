"""Programs compiled ahead of time, on a background thread, while the host does other work: the train call while
the state is restored or initialized and the loader's workers start, then the evaluation's loss while the first
calls train. A run then waits for a compile only where nothing else could run meanwhile.

XLA compiles outside Python's lock, so a compile overlaps the host's work (and, on a CPU, runs on a core the main
thread leaves); one compiling thread keeps them in the order they are needed.
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any, Callable

import jax
from jax.sharding import Mesh

_COMPILER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="compile-ahead")

# Whether a compile ahead should overlap another program's compile on the main thread. On 2 cores it gains nothing:
# XLA's CPU compiler keeps both busy, and the default run's train call compiled in 4.6 s alone but ~8 s beside the
# initialization's program (benchmarks/first_step.py); with more cores both go at full speed.
OVERLAP_COMPILES = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1) > 2
_queued: list[concurrent.futures.Future] = []


def cancel_queued() -> None:
    """Drops the compiles not yet started (a run that ends without needing them: a failure, a preemption), so that
    the interpreter's exit, which joins the compiling thread, waits at most for the one under way."""
    for future in _queued:
        future.cancel()
    _queued.clear()


class Ahead:
    """A jitted function's executable for one set of argument shapes and shardings, compiled on the background
    thread under `mesh` (the mesh in context is the thread's own: the attention's kernel choice reads it).
    Calling it waits for the compile, then runs the executable: its first call costs no compile of its own."""

    def __init__(self, jitted: Callable, mesh: Mesh, *abstract_args: Any):
        def compile_():
            with jax.set_mesh(mesh):
                return jitted.lower(*abstract_args).compile()

        self.future = _COMPILER.submit(compile_)
        _queued.append(self.future)

    def executable(self):
        """The compiled program (waits for its compile)."""
        return self.future.result()

    def __call__(self, *args):
        return self.future.result()(*args)
