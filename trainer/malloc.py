"""Process-wide host settings that the entry points (train.py, eval.py, the benchmark) apply first."""

from __future__ import annotations

import ctypes
import platform

# glibc's mallopt parameter numbers (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_NEVER = 2**31 - 1  # mallopt takes a C int


def keep_freed_memory() -> bool:
    """Make glibc keep large freed blocks for reuse instead of handing them back to the kernel.

    XLA:CPU allocates an executable's temporary buffers on every call (the `[B, T, V]` float32 logits and
    their gradient are 150 MB each at the CPU smoke shape). glibc serves blocks over 32 MB with a fresh
    `mmap` and unmaps them on `free`, so every call page-faults that memory in again, zeroed by the kernel:
    on the 2-core development machine this was ~25 % of a one-step train call (`python -m
    benchmarks.train_step --no-keep-freed-memory` shows it). One arena (a block freed by one thread is reused
    by any other), no `mmap` below 2 GiB and no trimming keep the pages resident; the process's resident
    memory then stays at its peak, which a training process reaches on its first step anyway.

    Call it before JAX starts its threads (threads that already have an arena keep it). Returns False, doing
    nothing, where the C library is not glibc (macOS, musl).
    """
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, _NEVER), (_M_TRIM_THRESHOLD, _NEVER))
    return all(libc.mallopt(param, value) == 1 for param, value in settings)
