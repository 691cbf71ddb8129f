"""Calibrates planning/op_cost.py against libtpu's own cost model: each op class the step-time estimate costs,
compiled on its own for a TPU topology (no TPU needed), our estimate vs libtpu's `optimal_seconds`.

    python -m planning.calibrate          # 4 generations × (3 rate probes + 9 classes × 6 shapes)
    python -m planning.calibrate --chips v5e v6e --draws 2 --seed 7 --json sweep.json --fit

Each op runs on every chip of a 4-chip mesh with replicated inputs (or rows split over the chips, where a class says
so), compiled with op_cost.HBM_ONLY; each chip gets its own draws. Shapes are drawn from the GPT-2 range: rows
512..16384, widths 64..6400, head dim 64 or 128, sequence 256..2048, vocabulary 50304 or 50257. The table has, per
program: ours (trainer/step_time.py's predicted_s), libtpu's optimal_seconds and their ratio, and `formula`: libtpu's
figure rebuilt from the HLO by its own accounting (op_cost's module docstring) at the rates in op_cost.RATES, to show
that formula and those rates are the whole of its model. `--fit` prints the rates fitted to this run's figures (each the
largest count / optimal_seconds over the programs; the rate probes attain them). About a second per compile: the default
sweep is ~230 compiles, ~5 minutes on 2 free cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another process may hold libtpu's lock; no TPU is used

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from gpt2 import model  # noqa: E402
from planning import (  # noqa: E402
    hlo,
    op_cost,  # noqa: E402
    step_time,
)

TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
CHIPS_PER_MESH = 4


@dataclasses.dataclass(frozen=True)
class Op:
    """One program: `fn` applied to arrays of `args` ((shape, dtype, split rows over the mesh?) each)."""

    op_class: str
    shape: str  # what was drawn, for the table and for a failing test's message
    fn: Callable
    args: tuple[tuple[tuple[int, ...], str, bool], ...]


def _rows(rng) -> int:
    return int(rng.integers(4, 129)) * 128  # 512..16384


def _width(rng, low: int = 64, high: int = 6400) -> int:
    return int(rng.integers(low // 64, high // 64 + 1)) * 64


def _attention_shape(rng) -> tuple[int, int, int, int]:
    """(b, h, T, K) for one chip: the model's heads at its width, as many sequences as keep [b, h, T, T] scores
    within 1 GiB of bfloat16."""
    K = int(rng.choice([64, 128]))
    T = int(rng.integers(2, 17)) * 128  # 256..2048
    h = _width(rng, 768, 1600) // K
    b = max(1, min(16384 // T, 2**29 // (h * T * T)))
    return int(rng.integers(1, b + 1)), h, T, K


def matmul(rng) -> Op:
    """A projection (x @ w), its weight gradient (xᵀ @ dy, contracting the rows) or its input gradient (dy @ wᵀ)."""
    M, K, N = _rows(rng), _width(rng), _width(rng)
    form = str(rng.choice(["x@w", "x.T@dy", "dy@w.T"]))
    split = form != "x.T@dy" and bool(rng.integers(2))  # rows over the mesh, as the train step's activations
    rows = M * CHIPS_PER_MESH if split else M
    shape = f"{form} M={M} K={K} N={N}" + (" (rows split)" if split else "")
    if form == "x@w":
        return Op("matmul", shape, lambda x, w: x @ w, (((rows, K), "bf16", split), ((K, N), "bf16", False)))
    if form == "x.T@dy":
        return Op("matmul", shape, lambda x, dy: x.T @ dy, (((M, K), "bf16", False), ((M, N), "bf16", False)))
    return Op("matmul", shape, lambda dy, w: dy @ w.T, (((rows, N), "bf16", split), ((K, N), "bf16", False)))


def attention(rng) -> Op:
    """XLA attention's batched matmuls: scores QKᵀ (contracting the head dim) or PV (a head-dim-wide result)."""
    b, h, T, K = _attention_shape(rng)
    form = str(rng.choice(["qk", "pv"]))
    shape = f"{form} b={b} h={h} T={T} K={K}"
    if form == "qk":
        return Op("attention", shape, lambda q, k: jnp.einsum("bhtk,bhsk->bhts", q, k),
                  (((b, h, T, K), "bf16", False), ((b, h, T, K), "bf16", False)))
    return Op("attention", shape, lambda p, v: jnp.einsum("bhts,bhsk->bhtk", p, v),
              (((b, h, T, T), "bf16", False), ((b, h, T, K), "bf16", False)))


def softmax(rng) -> Op:
    """The causal softmax over keys of XLA attention's scores, in float32."""
    b, h, T, _ = _attention_shape(rng)

    def f(s):
        causal = jnp.tril(jnp.ones((T, T), bool))
        return jax.nn.softmax(jnp.where(causal, s.astype(jnp.float32), -jnp.inf), axis=-1).astype(jnp.bfloat16)

    return Op("softmax", f"b={b} h={h} T={T}", f, (((b, h, T, T), "bf16", False),))


def layer_norm(rng) -> Op:
    """Layer norm over D (row reductions, rsqrt), in float32 from bfloat16."""
    M, D = _rows(rng), _width(rng, 768, 1600)

    def f(x, scale, bias):
        x = x.astype(jnp.float32)
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return ((x - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias).astype(jnp.bfloat16)

    return Op("layer_norm", f"M={M} D={D}", f, (((M, D), "bf16", False), ((D,), "f32", False), ((D,), "f32", False)))


def gelu(rng) -> Op:
    """GPT-2's tanh GELU on the MLP's hidden activations."""
    M, F = _rows(rng), _width(rng)
    return Op("gelu", f"M={M} F={F}", lambda x: jax.nn.gelu(x, approximate=True), (((M, F), "bf16", False),))


def cross_entropy(rng) -> Op:
    """The loss over the vocabulary (logsumexp minus the label's logit) or its gradient (softmax - one-hot)."""
    M, V = _rows(rng) // 2, int(rng.choice([50304, 50257]))  # [M, V] float32: up to 1.6 GB
    grad = bool(rng.integers(2))

    def loss(logits, labels):  # the model's own (gpt2/model.py), whose gradient is already bf16
        return model.cross_entropy(logits, labels).mean()

    f = jax.grad(loss) if grad else loss
    return Op("cross_entropy", f"{'gradient' if grad else 'loss'} M={M} V={V}", f,
              (((M, V), "bf16", False), ((M,), "s32", False)))


def column_sum(rng) -> Op:
    """A bias's gradient: a column reduction over the rows, in float32."""
    M, N = _rows(rng), _width(rng)
    return Op("column_sum", f"M={M} N={N}", lambda dy: dy.astype(jnp.float32).sum(0), (((M, N), "bf16", False),))


def transpose(rng) -> Op:
    """Attention's heads-first copy: [B, T, H, K] -> [B, H, T, K]."""
    b, h, T, K = _attention_shape(rng)
    return Op("transpose", f"b={b} T={T} h={h} K={K}", lambda x: jnp.swapaxes(x, 1, 2).copy(),
              (((b, T, h, K), "bf16", False),))


def adamw(rng) -> Op:
    """AdamW's update of a float32 weight matrix (elementwise over four arrays, a sqrt per element)."""
    D, F = _width(rng, 64, 1600), _width(rng)

    def f(p, g, m, v):
        m = 0.9 * m + 0.1 * g
        v = 0.95 * v + 0.05 * g * g
        return p - 1e-4 * (m / (jnp.sqrt(v) + 1e-8) + 0.1 * p), m, v

    return Op("adamw", f"{D}x{F}", f, tuple(((D, F), "f32", False) for _ in range(4)))


OP_CLASSES: dict[str, Callable[[np.random.Generator], Op]] = {
    f.__name__: f for f in (matmul, attention, softmax, layer_norm, gelu, cross_entropy, column_sum, transpose, adamw)
}

# Programs bound by each of libtpu's three terms, which fix its rates: the MXU (a big square matmul), HBM (an add)
# and the transcendental unit (exp of an outer product summed away: 67 M exps on 64 KiB of data).
RATE_PROBES = (
    Op("probe: MXU", "8192^3", lambda x, w: x @ w, (((8192, 8192), "bf16", False),) * 2),
    Op("probe: HBM", "add 8192^2", lambda x, y: x + y, (((8192, 8192), "bf16", False),) * 2),
    Op("probe: exp", "8192 x 8192 outer", lambda x, y: jnp.exp(x[:, None] * y[None, :]).sum(-1),
       (((8192,), "f32", False),) * 2),
)


def mesh_for(chip: str) -> jax.sharding.Mesh:
    from planning.aot import topology_devices

    return jax.make_mesh((CHIPS_PER_MESH,), ("data",), devices=topology_devices(TOPOLOGIES[chip]))


def compile_op(op: Op, mesh: jax.sharding.Mesh, options: dict | None = None):
    args = [jax.ShapeDtypeStruct(shape, jnp.dtype({"bf16": "bfloat16", "f32": "float32", "s32": "int32"}[dtype]),
                                 sharding=NamedSharding(mesh, P("data") if split else P()))
            for shape, dtype, split in op.args]
    with jax.set_mesh(mesh):
        return jax.jit(op.fn).lower(*args).compile(compiler_options=op_cost.HBM_ONLY if options is None else options)


def libtpu_seconds(compiled) -> float:
    """libtpu's optimal_seconds without the -1 s it counts for each ConcatBitcast of the entry computation (a sliced
    prefetch's glue, planning/aot.py), which a default compile of an op on a large array has: a 768 × 50257
    cross-entropy on v4 read -0.9994 s (STEP_TIME_SEED=1032046844 in tests/unit/test_step_time.py), 0.00055 without."""
    cost = compiled.cost_analysis()
    comps, entry = hlo.parse_hlo(compiled.as_text())
    glued = sum(i.opcode == "custom-call" and i.attr("custom_call_target") == '"ConcatBitcast"'
                for i in comps[entry].instrs.values())
    return float((cost[0] if isinstance(cost, list) else cost)["optimal_seconds"]) + glued


def ours_seconds(compiled, chip: str) -> float:
    return step_time.estimate_hlo(compiled.as_text(), chip, {"data": CHIPS_PER_MESH}, fixed_costs=False).predicted_s


def libtpu_formula(text: str, chip: str) -> float:
    """libtpu's optimal_seconds rebuilt: Σ over the entry computation's instructions of max(MXU FLOPs / rate,
    transcendentals / rate, bytes / rate), every memory space's bytes at the HBM rate (a copy into VMEM: its
    operand and its two-array result, then the copy-done's result). Elementwise FLOPs, which libtpu charges at the
    MXU rate too, are left out (never binding)."""
    comps, entry = hlo.parse_hlo(re.sub(r"S\(\d+\)", "", text))  # every array "in HBM"
    walker = step_time._Walker(comps, step_time.CHIPS[chip], {"data": CHIPS_PER_MESH})
    rates, comp, total = op_cost.RATES[chip], comps[entry], 0.0
    for instr in comp.instrs.values():
        if instr.opcode in step_time.FREE:
            continue
        if instr.opcode in ("copy-start", "copy-done"):
            nbytes = instr.arrays[0].bytes * (3 if instr.opcode == "copy-start" else 1)
        else:
            nbytes = walker.hbm_bytes(instr, comp)
        total += max(op_cost.compute_seconds(rates, walker.flops(instr, comp), walker.transcendentals(instr, comp)),
                     op_cost.memory_seconds(rates, nbytes))
    return total


@dataclasses.dataclass
class Row:
    op_class: str
    chip: str
    shape: str
    ours_s: float
    libtpu_s: float
    formula_s: float
    counts: dict  # libtpu's flops, transcendentals, bytes accessed

    @property
    def ratio(self) -> float:
        return self.ours_s / self.libtpu_s


def measure(op: Op, chip: str, mesh, options: dict | None = None) -> Row:
    compiled = compile_op(op, mesh, options)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    counts = {k: float(cost.get(k, 0.0)) for k in ("flops", "transcendentals", "bytes accessed")}
    text = compiled.as_text()
    return Row(op.op_class, chip, op.shape, ours_seconds(compiled, chip), libtpu_seconds(compiled),
               libtpu_formula(text, chip), counts)


def fit(rows: list[Row]) -> dict[str, op_cost.Rates]:
    """Per chip, each rate as the largest count / optimal_seconds: a program's time is at least each of its
    counts at its rate, with equality for a program bound by that term throughout."""
    def best(chip: str, key: str) -> float:
        return max(r.counts[key] / r.libtpu_s for r in rows if r.chip == chip)

    return {chip: op_cost.Rates(best(chip, "flops"), best(chip, "transcendentals"), best(chip, "bytes accessed"))
            for chip in sorted({r.chip for r in rows})}


def summary(rows: list[Row]) -> list[str]:
    """Per op class and chip: how many programs, the median and extreme ratios ours / libtpu."""
    lines = [f"{'op class':16s} {'chip':5s} {'n':>3s} {'median':>7s} {'min':>6s} {'max':>6s}  formula max |err|"]
    for key in sorted({(r.op_class, r.chip) for r in rows}):
        mine = [r for r in rows if (r.op_class, r.chip) == key]
        ratios = [r.ratio for r in mine]
        err = max(abs(r.formula_s / r.libtpu_s - 1) for r in mine)
        lines.append(f"{key[0]:16s} {key[1]:5s} {len(mine):3d} {statistics.median(ratios):7.3f} {min(ratios):6.3f}"
                     f" {max(ratios):6.3f}  {err:.2%}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chips", nargs="+", default=list(TOPOLOGIES), choices=list(TOPOLOGIES))
    parser.add_argument("--classes", nargs="+", default=list(OP_CLASSES), choices=list(OP_CLASSES))
    parser.add_argument("--draws", type=int, default=6, help="random shapes per op class and chip")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fit", action="store_true", help="print the rates fitted to this run's figures")
    parser.add_argument("--default-compile", action="store_true",
                        help="compile with the compiler's defaults (VMEM prefetches), where libtpu's accounting and"
                             " ours part: the formula column still matches libtpu")
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args(argv)
    rows, start = [], time.time()
    print(f"{'op class':16s} {'chip':5s} {'ours us':>10s} {'libtpu us':>10s} {'ratio':>6s} {'formula':>7s}  shape")
    for chip in args.chips:
        mesh, rng = mesh_for(chip), np.random.default_rng([args.seed, list(TOPOLOGIES).index(chip)])
        ops = [*RATE_PROBES, *(OP_CLASSES[c](rng) for c in args.classes for _ in range(args.draws))]
        for op in ops:
            r = measure(op, chip, mesh, {} if args.default_compile else None)
            rows.append(r)
            print(f"{r.op_class:16s} {chip:5s} {r.ours_s * 1e6:10.2f} {r.libtpu_s * 1e6:10.2f} {r.ratio:6.3f}"
                  f" {r.formula_s / r.libtpu_s:7.3f}  {r.shape}", flush=True)
    print(f"\n{len(rows)} programs in {time.time() - start:.0f} s; ours / libtpu per op class (probes included):")
    print("\n".join(summary(rows)))
    if args.fit:
        for chip, rates in fit(rows).items():
            print(f"fitted {chip}: {rates}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
