"""What one op of a compiled TPU program costs one chip, at the rates of libtpu's own cost model.

libtpu's `optimal_seconds` (`compiled.cost_analysis()`) for a program of standalone ops is, within 1.9 % (median
0.0 %) on every op class planning/calibrate.py sweeps, the sum over the program's instructions of

    max(FLOPs / mxu_flops_per_s, transcendentals / transcendentals_per_s, bytes / hbm_bytes_per_s)

with three rates per chip (RATES) and these counts:
- FLOPs as written: a matmul's 2·M·K·N with no padding to the MXU's 128 or 256 tile (a [8192, 1100] × [1100,
  1100] matmul costs its own FLOPs on every generation), float32 at the bfloat16 rate, and no size-dependent
  efficiency (512³ to 8192³ all run at the same rate);
- transcendentals (exp, log, tanh, rsqrt, ...): one per element, at one per vector lane per clock;
- bytes: every operand and result at its stored size, tile padding included (planning/hlo.py's
  stored_elements).
Reductions, transposes and elementwise arithmetic have no term of their own (libtpu counts elementwise FLOPs at
the MXU's rate, 1/200 of their bytes' time or less; we leave them out).

The gaps our old per-op roofline showed against libtpu (1.1-5.7x) were accounting, not efficiency: tile padding
(head_dim 64 stored 128 wide), HBM rates below the published peaks, a fusion read we missed, and libtpu's VMEM.
For a program whose input the compiler prefetches into VMEM, libtpu charges that copy four times the array's size
(its operand, its two-array result, then the copy-done's result) and each later read from VMEM once more, all at
the HBM rate and in series. planning/step_time.py counts bytes where they move instead: VMEM (layout memory space
S(1)) costs no HBM time, and an async copy is a DMA beside the compute. The calibration therefore compiles its
ops without memory-space assignment (HBM_ONLY), where both count the same bytes.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from planning.hlo import Computation, Instr


@dataclasses.dataclass(frozen=True)
class Rates:
    """libtpu's rates for one chip (one JAX device: both TensorCores of a megacore v4 / v5p chip)."""

    mxu_flops_per_s: float
    transcendentals_per_s: float
    hbm_bytes_per_s: float


# Fitted to the sweep in planning/calibrate.py on 2026-11-25, libtpu 0.0.42.1 (jax 0.10.2): 228 programs
# (per chip 3 rate probes + 9 op classes × 6 GPT-2 shapes), each rate the largest count / optimal_seconds over
# them, which the probe bound by that term attains. Our estimate / libtpu over the sweep: median 1.000, range
# 0.981-1.000 (max error 1.9 %, on the cross-entropy: libtpu charges its label gather 5-8 KB per gathered element,
# a tile's worth, where we count the element).
# Against the published peaks (planning/chips.py): the MXU at 100 % of peak but on v5p (86 %: 394 of
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


# ---- the work an op does: MXU FLOPs of convolutions, dots and splash kernels, their exps --------------------

def _labels(instr: Instr) -> tuple[str, str, str]:
    lhs, rest = instr.attr("dim_labels").split("_")
    rhs, out = rest.split("->")
    return lhs, rhs, out


def _window(instr: Instr, rank: int) -> dict[str, list]:
    """The convolution window's per-spatial-dimension fields (size, stride, pad, lhs/rhs dilation)."""
    w = {"size": [1] * rank, "stride": [1] * rank, "pad": [(0, 0)] * rank, "lhs_dilate": [1] * rank,
         "rhs_dilate": [1] * rank}
    m = re.search(r"window=\{([^}]*)\}", instr.attrs)
    for field in (m.group(1).split() if m else []):
        key, value = field.split("=")
        if key == "pad":
            w["pad"] = [tuple(int(p) for p in part.split("_")) for part in value.split("x")]
        elif key in w:
            w[key] = [int(v) for v in value.split("x")]
    return w


def _valid_taps(in_size: int, out_size: int, size: int, stride: int, pad: tuple[int, int], lhs_dilate: int,
                rhs_dilate: int) -> int:
    """(output position, window tap) pairs that land on a real input element along one spatial dimension.

    TPU HLO writes batched matmuls as convolutions with base dilation (`lhs_dilate`), where most taps land in the
    dilation holes; counting only real taps gives the matmul's true FLOPs (as XLA's own cost analysis does).
    """
    o = np.arange(out_size)[:, None]
    k = np.arange(size)[None, :]
    p = o * stride + k * rhs_dilate - pad[0]
    real = (p >= 0) & (p <= (in_size - 1) * lhs_dilate) & (p % lhs_dilate == 0)
    return int(real.sum())


def convolution_flops(instr: Instr, comp: Computation) -> float:
    """2 × output batch × output features × kernel input features × real window taps."""
    lhs_labels, rhs_labels, out_labels = _labels(instr)
    lhs, rhs, out = comp.instrs[instr.operands[0]].arrays[0], comp.instrs[instr.operands[1]].arrays[0], instr.arrays[0]
    spatial = [c for c in out_labels if c.isdigit()]
    w = _window(instr, len(spatial))
    taps = 1
    for d, c in enumerate(sorted(spatial)):
        taps *= _valid_taps(lhs.dims[lhs_labels.index(c)], out.dims[out_labels.index(c)], w["size"][d],
                            w["stride"][d], w["pad"][d], w["lhs_dilate"][d], w["rhs_dilate"][d])
    batch, features = out.dims[out_labels.index("b")], out.dims[out_labels.index("f")]
    return 2.0 * batch * features * rhs.dims[rhs_labels.index("i")] * taps


def dot_flops(instr: Instr, comp: Computation) -> float:
    """2 × output elements × contracted elements."""
    lhs = comp.instrs[instr.operands[0]].arrays[0]
    contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", instr.attrs)
    dims = [int(d) for d in contracting.group(1).split(",") if d] if contracting else []
    return 2.0 * math.prod(instr.arrays[0].dims) * math.prod(lhs.dims[d] for d in dims)


# The splash kernels (gpt2/splash.py) by name, and the [bq, K] × [K, bkv] matmuls each runs per computed block:
# forward QKᵀ and PV; dq recomputes QKᵀ, then dP = dO Vᵀ and dQ = dS K; dkv recomputes QKᵀ and dP, then
# dV = Pᵀ dO and dK = dSᵀ Q (splash_attention_kernel.py's _flash_attention_kernel, _flash_attention_dq_kernel,
# _flash_attention_dkv_kernel). Each of the three also takes one exp per score of the block: the forward's
# softmax numerator, and the backward kernels' P = exp(S - logsumexp), recomputed rather than stored.
SPLASH_MATMULS = {"splash_mha_fwd": 2, "splash_mha_dq": 3, "splash_mha_dkv": 4}
SPLASH_EXPS_PER_SCORE = 1


def splash_work(instr: Instr, comp: Computation) -> tuple[float, float]:
    """A splash kernel's (MXU FLOPs, exps), from its operands: q [b, h, T, K] and its block mask [., nq, nkv], of
    whose blocks a causal mask computes those on or below the diagonal (the kernel skips the rest). libtpu
    cannot cost a Pallas kernel; these are the counts its model charges the equivalent XLA dots and exp.
    (0, 0) for another Pallas kernel (its work is not stated anywhere in the HLO)."""
    matmuls = next((n for name, n in SPLASH_MATMULS.items() if instr.name.startswith(name)), None)
    operands = [comp.instrs[o].arrays[0] for o in instr.operands if o in comp.instrs and comp.instrs[o].arrays]
    q = next((a for a in operands if len(a.dims) == 4 and a.dtype in ("bf16", "f32", "f16")), None)
    mask = operands[0] if operands and len(operands[0].dims) == 3 else None
    if matmuls is None or q is None or mask is None:
        return 0.0, 0.0
    b, h, T, K = q.dims
    nq, nkv = mask.dims[1:]
    bq, bkv = T // nq, T // nkv
    blocks = sum(1 for i in range(nq) for j in range(nkv) if j * bkv <= i * bq + bq - 1)  # causal
    scores = b * h * blocks * bq * bkv
    return 2.0 * matmuls * scores * K, SPLASH_EXPS_PER_SCORE * scores
