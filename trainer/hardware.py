"""Hardware facts training needs: each accelerator's peak FLOP/s, and this machine's measured CPU peak (MFU on a
laptop). The TPU generations' other figures (HBM, ICI, DCN), which only planning reads, are in planning/chips.py.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from trainer.storage.files import atomic_write

# Dense bf16 peak FLOP/s per chip, from the vendors' spec sheets.
PEAK_FLOPS = {
    "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5": 459e12, "TPU v5p": 459e12,
    "TPU v6 lite": 918e12, "TPU v6e": 918e12,
    "NVIDIA H100": 989e12, "NVIDIA H200": 989e12, "NVIDIA A100": 312e12,  # SXM, dense
}


PEAK_CACHE = "~/.cache/gpt2_nnx/cpu_peak_flops.json"
SAMPLES = 3  # measurements of the CPU peak kept the best of, one per start, before it is only read


# What this trainer's train call reaches, as a fraction of the peak: 40-41 % on an H100/H200 at GPT-2 124M's shape,
# 45-57 % on CPUs (docs/performance.md). The start-up's step-time estimate assumes it.
TYPICAL_MFU = 0.4


@functools.lru_cache(maxsize=None)  # one measurement per process (a CPU's is timed)
def peak_flops_per_device(override: float | None) -> float:
    """The config's value, a known accelerator's spec, or (CPU) this machine's float32 matmul peak.

    The CPU peak is the best measured on this machine (CPU model, core count, JAX version), kept in PEAK_CACHE
    so that MFU compares across runs: timed afresh at each start-up on a busy machine it swung by tens of
    percent, and a first measurement made under load (a test suite on every core) was 30× too low.
    """
    if override:
        return override
    kind = jax.devices()[0].device_kind
    for name, flops in PEAK_FLOPS.items():
        if kind.startswith(name):
            return flops
    return cpu_peak_flops() / jax.local_device_count()


def cpu_peak_flops() -> float:
    """The best of the first SAMPLES measurements on this machine; later starts read it (a measurement takes ~0.3 s
    on a quiet 2-core machine, seconds on a busy one: a test suite's hundred runs paid minutes for it)."""
    path = epath.Path(os.path.expanduser(PEAK_CACHE))
    key = f"{_cpu_model()} | {os.cpu_count()} cores | jax {jax.__version__}"
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    cache = cache if isinstance(cache, dict) else {}
    entry = cache.get(key)
    if isinstance(entry, (int, float)):  # written before samples were counted
        entry = {"flops": float(entry), "samples": 1}
    known = entry if isinstance(entry, dict) and isinstance(entry.get("flops"), (int, float)) else None
    if known is not None and (known.get("samples", 1) >= SAMPLES or jax.process_index() > 0):
        return float(known["flops"])  # process 0 logs MFU; the others need not slow it
    measured = measure_matmul_peak(repeats=10 if known is None else 3)
    best = max(measured, known["flops"]) if known else measured  # a busy machine only ever measures too low
    cache[key] = {"flops": best, "samples": (known.get("samples", 1) if known else 0) + 1}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(cache, indent=2))
    except OSError:
        pass  # an unwritable cache only costs the measurement next time
    return best


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_matmul_peak(n: int = 2048, dtype=np.float32, repeats: int = 5) -> float:
    """Best-of-`repeats` FLOP/s of an n×n matmul on the default backend (all its threads)."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best
