"""What one op of a compiled TPU program costs one chip, at the rates of libtpu's own cost model.

libtpu's `optimal_seconds` (`compiled.cost_analysis()`) for a program of standalone ops is, within 1.9 % (median
0.0 %) on every op class benchmarks/calibrate_step_time.py sweeps, the sum over the program's instructions of

    max(FLOPs / mxu_flops_per_s, transcendentals / transcendentals_per_s, bytes / hbm_bytes_per_s)

with three rates per chip (RATES) and these counts:
- FLOPs as written: a matmul's 2·M·K·N with no padding to the MXU's 128 or 256 tile (a [8192, 1100] × [1100,
  1100] matmul costs its own FLOPs on every generation), float32 at the bfloat16 rate, and no size-dependent
  efficiency (512³ to 8192³ all run at the same rate);
- transcendentals (exp, log, tanh, rsqrt, ...): one per element, at one per vector lane per clock;
- bytes: every operand and result at its stored size, tile padding included (TILE_PAD_EXAMPLE).
Reductions, transposes and elementwise arithmetic have no term of their own (libtpu counts elementwise FLOPs at
the MXU's rate, 1/200 of their bytes' time or less; we leave them out).

The gaps our old per-op roofline showed against libtpu (1.1-5.7x) were accounting, not efficiency: tile padding
(head_dim 64 stored 128 wide), HBM rates below the published peaks, a fusion read we missed, and libtpu's VMEM.
For a program whose input the compiler prefetches into VMEM, libtpu charges that copy four times the array's size
(its operand, its two-array result, then the copy-done's result) and each later read from VMEM once more, all at
the HBM rate and in series. trainer/step_time.py counts bytes where they move instead: VMEM (layout memory space
S(1)) costs no HBM time, and an async copy is a DMA beside the compute. The calibration therefore compiles its
ops without memory-space assignment (HBM_ONLY), where both count the same bytes.
"""

from __future__ import annotations

import dataclasses
import math
import re


@dataclasses.dataclass(frozen=True)
class Rates:
    """libtpu's rates for one chip (one JAX device: both TensorCores of a megacore v4 / v5p chip)."""

    mxu_flops_per_s: float
    transcendentals_per_s: float
    hbm_bytes_per_s: float


# Fitted to the sweep in benchmarks/calibrate_step_time.py on 2026-11-25, libtpu 0.0.42.1 (jax 0.10.2): 228 programs
# (per chip 3 rate probes + 9 op classes × 6 GPT-2 shapes), each rate the largest count / optimal_seconds over
# them, which the probe bound by that term attains. Our estimate / libtpu over the sweep: median 1.000, range
# 0.981-1.000 (max error 1.9 %, on the cross-entropy: libtpu charges its label gather 5-8 KB per gathered element,
# a tile's worth, where we count the element).
# Against the published peaks (trainer/step_time.py's CHIPS): the MXU at 100 % of peak but on v5p (86 %: 394 of
# 459 TFLOP/s), HBM at 82 % (v4), 90 % (v5e), 85 % (v5p), 100 % (v6e); transcendentals at 1024 lanes × clock
# (v4 1.05 GHz, v5e 1.5, v6e 1.75) and 2048 × 1.5 GHz on v5p.
RATES = {
    "v4": Rates(mxu_flops_per_s=274.0e12, transcendentals_per_s=1.0755e12, hbm_bytes_per_s=982.5e9),
    "v5e": Rates(mxu_flops_per_s=197.0e12, transcendentals_per_s=1.536e12, hbm_bytes_per_s=737.7e9),
    "v5p": Rates(mxu_flops_per_s=394.0e12, transcendentals_per_s=3.072e12, hbm_bytes_per_s=2350.4e9),
    "v6e": Rates(mxu_flops_per_s=918.0e12, transcendentals_per_s=1.792e12, hbm_bytes_per_s=1638.0e9),
}

# Compile options that keep a standalone op's arrays in HBM: no memory-space assignment (no prefetch into VMEM,
# no cross-program prefetch), for which libtpu's accounting and ours count the same bytes (module docstring).
HBM_ONLY = {"xla_msa_enable": False}

# HLO opcodes libtpu counts as transcendentals (XLA's HloCostAnalysis: one per result element)
TRANSCENDENTAL = {"exponential", "exponential-minus-one", "log", "log-plus-one", "logistic", "power", "sqrt", "cbrt",
                  "rsqrt", "tanh", "sine", "cosine", "tan", "atan2", "erf"}

# A float32 [8192, 100] array laid out {0,1:T(8,128)} is stored as 100 rows of 8192, the 100 padded to 104 (the
# tile's 8): libtpu counts 8192 × 104 × 4 bytes for it, and so do we.
TILE_PAD_EXAMPLE = ((8192, 100), "0,1:T(8,128)", 8192 * 104)


def stored_elements(dims: tuple[int, ...], layout: str) -> int:
    """Elements an array occupies under its layout ("1,0:T(8,128)(2,1)S(1)"): its first tile pads the minor
    dimensions (in minor-to-major order) to whole tiles; later tiles ((2,1): bfloat16 pairs) pack within it."""
    minor_to_major, _, rest = layout.partition(":")
    order = [int(d) for d in minor_to_major.split(",") if d.strip()]
    tile = re.match(r"T\(([0-9,]+)\)", rest)
    if not dims or not tile or len(order) != len(dims):
        return math.prod(dims)
    physical = [dims[d] for d in reversed(order)]  # major to minor
    for i, size in enumerate(reversed([int(t) for t in tile.group(1).split(",")])):
        if i < len(physical):
            j = len(physical) - 1 - i
            physical[j] = -(-physical[j] // size) * size
    return math.prod(physical)


def compute_seconds(rates: Rates, mxu_flops: float, transcendentals: float) -> float:
    """An op's time in its compute units: the MXU or the transcendental unit, whichever it keeps busier."""
    return max(mxu_flops / rates.mxu_flops_per_s, transcendentals / rates.transcendentals_per_s)


def memory_seconds(rates: Rates, hbm_bytes: float) -> float:
    return hbm_bytes / rates.hbm_bytes_per_s


def op_seconds(rates: Rates, mxu_flops: float, transcendentals: float, hbm_bytes: float) -> float:
    """One op: its compute overlaps its own HBM traffic (the op streams tiles through VMEM), so the slower wins."""
    return max(compute_seconds(rates, mxu_flops, transcendentals), memory_seconds(rates, hbm_bytes))


def kernel_compute_seconds(rates: Rates, mxu_flops: float, transcendentals: float) -> float:
    """A splash attention kernel (libtpu cannot cost Pallas kernels): within each block its exp sits between the
    matmul that makes the scores and the one that consumes them (S = QKᵀ, P = exp(S - m), PV), so the MXU and
    the transcendental unit take turns rather than overlap."""
    return mxu_flops / rates.mxu_flops_per_s + transcendentals / rates.transcendentals_per_s
