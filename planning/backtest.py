"""The step-time model against published measurements: each entry is a dense decoder whose training step was
measured on a TPU and published with its configuration; its closest GPT-2-architecture analog is compiled for the
same topology (`plan.py`, stored by planning/compile_store.py) and its predicted step set beside the measured one.

    python -m planning.backtest                   # every entry (the first run compiles: minutes to an hour)
    python -m planning.backtest --entries marin_300m maxtext_22b_v4 --json out.json

The analog keeps the source's depth, width, heads, sequence length, vocabulary, global batch, chips and sharding
(FSDP over every chip, as the sources ran), with this model's architecture: learned positions, LayerNorm, a GELU
MLP of 4·d, multi-head attention, a tied head. Its FLOPs differ from the source's (SwiGLU's three matrices, GQA,
an untied head), so the comparison is made at equal MFU: `target` is the step the analog would take at the
source's measured MFU, `source step × analog FLOPs / source FLOPs` (both 6N + non-causal attention per token, this
project's convention), and the ratio is predicted / target. Sources and derivations: docs/aot_planning.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math

import configs
from configs.base import Config
from configs.cli import parse
from planning.aot import chip_of, compile_train_call
from planning.step_time import OP_OVERHEAD_S, estimate_hlo, torus


@dataclasses.dataclass(frozen=True)
class Published:
    """A measured step and what it takes to compile its analog."""

    name: str
    source: str  # where the figure is published, and the quote or derivation
    topology: str
    measured_s: float  # the source's step time
    source_flops_per_token: float  # what the source's chips computed: 6N + attention + the forward it recomputed
    model: tuple[int, int, int, int, int]  # the analog's n_layer, n_head, n_embd, seq_len, vocab
    batch: int  # global sequences per step
    micro_batches: int = 1  # the analog's gradient accumulation, where the source's step does not fit it whole

    def flags(self) -> list[str]:
        layers, heads, width, seq, vocab = self.model
        return [f"--model.n_layer={layers}", f"--model.n_head={heads}", f"--model.n_embd={width}",
                f"--model.block_size={seq}", f"--model.vocab_size={vocab}", "--model.pad_vocab_to=128",
                "--model.scan_layers=true", "--model.remat=full", "--model.document_mask=false",
                "--model.document_positions=false", f"--train.seq_len={seq}", f"--train.batch_size={self.batch}",
                f"--train.grad_accum={self.micro_batches}", "--train.steps_per_call=1", "--mesh.data=1",
                "--mesh.fsdp=-1", "--mesh.tensor=1", "--mesh.rules=fsdp", "--guard.skip_spikes=false"]

    def config(self) -> Config:
        return parse(Config, self.flags(), default=configs.load("gpt2_124m"), prog="backtest")

    def analog_flops_per_token(self) -> float:
        """6N + attention + the forward that full remat recomputes (the blocks' matmuls and attention)."""
        m, seq = self.config().model, self.model[3]
        return m.flops_per_token(seq) + 2 * m.num_params(include_embedding=False) + 4 * m.n_layer * m.n_embd * seq

    def target_s(self) -> float:
        """The analog's step if its chips computed at the source's measured rate (recomputation included)."""
        return self.measured_s * self.analog_flops_per_token() / self.source_flops_per_token


def _llama_flops(d: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int,
                 recompute: str = "full") -> float:
    """Per token of a Llama-style decoder (SwiGLU, GQA, untied head; N: its matmul weights): 6N + 12·L·T·d, plus
    the forward it recomputes in the backward pass — "full": every block (2·N_blocks + 4·L·T·d); "mlp+attention":
    the MLP and the attention scores (MaxText's custom policy that offloads the projections and the block input)."""
    hd = d // heads
    projections = layers * (2 * d * heads * hd + 2 * d * kv_heads * hd)
    mlp = layers * 3 * d * ffn
    attention = 4 * layers * seq * heads * hd  # QKᵀ and PV, forward
    recomputed = {"full": 2 * (projections + mlp) + attention, "mlp+attention": 2 * mlp + attention}[recompute]
    return 6 * (projections + mlp + vocab * d) + 3 * attention + recomputed


def _maxtext_2023_flops(d: int, layers: int, heads: int, head_dim: int, mlp: int, vocab: int, seq: int) -> float:
    """MaxText's 2023 decoder (ReLU MLP, tied head), remat "full": 6N + 12·L·T·heads·head_dim per token, plus the
    blocks' forward recomputed."""
    blocks = layers * (4 * d * heads * head_dim + 2 * d * mlp)
    attention = 4 * layers * seq * heads * head_dim
    return 6 * (blocks + vocab * d) + 3 * attention + 2 * blocks + attention


TPU_RECIPES = "AI-Hypercomputer/tpu-recipes@d95a9dc training/trillium/Llama3.1-8B-MaxText/v6e-8/README.md"
MAXTEXT_LLAMA = ("AI-Hypercomputer/maxtext@e591f30 benchmarks/maxtext_trillium_model_configs.py llama3_1_8b_8192:"
                 " remat_policy custom, decoder_layer_input and the q/k/v/out projections offloaded to the host")
MARIN = ("marin-community/marin@75d9c2c7 experiments/speedrun/adamw_llama_scaling/{}/speedrun_results.json:"
         " training_time / num_train_steps (Levanter's per-step durations over the whole run), 16 chips")
MARIN_130M = ("marin-community/marin@3cb4a05 experiments/speedrun/adamw_llama_scaling/130m/speedrun_results.json:"
              " 1125.39 s / 4959 steps (MFU 21.5 %), v5p-32 (16 chips), 128 sequences of 4096, width 512, 6 layers")
MARIN_150M = ("marin-community/marin@3958e04 experiments/speedrun/llama_150m_run/speedrun_results.json: 285.40 s /"
              " 3000 steps (MFU 17.8 %), v4-128 (64 chips), 512 sequences of 1024 (8 per chip), width 512, 6 layers;"
              " Levanter's first logged step includes its compilation, so the steady step is shorter by an unpublished"
              " compile time / 3000")
ENTRIES = [
    Published("llama3_8b_v6e8", f"{TPU_RECIPES}: 'completed step: 14, seconds: 3.443, TFLOP/s/device: 413.433'"
              f" (MFU 45.0 %); 3 sequences of 8192 per chip, FSDP 8; {MAXTEXT_LLAMA}", "v6e:2x4", 3.443,
              _llama_flops(4096, 32, 32, 8, 14336, 128256, 8192, recompute="mlp+attention"),
              (32, 32, 4096, 8192, 128256), 24, micro_batches=3),  # whole, it needs 35.4 GiB of the 31.25
    Published("marin_130m", MARIN_130M, "v5p:2x2x4", 1125.39 / 4959,
              _llama_flops(512, 6, 8, 8, 1792, 128256, 4096), (6, 8, 512, 4096, 128256), 128),
    Published("marin_150m_v4", MARIN_150M, "v4:4x4x4", 285.40 / 3000,
              _llama_flops(512, 6, 8, 8, 1792, 128256, 1024), (6, 8, 512, 1024, 128256), 512),
    Published("marin_300m", MARIN.format("300m") + ": 5250.40 s / 11444 steps (MFU 25.8 %)", "v5p:2x2x4",
              5250.40 / 11444, _llama_flops(768, 12, 12, 12, 2688, 128256, 4096), (12, 12, 768, 4096, 128256), 128),
    Published("marin_520m", MARIN.format("520m") + ": 18757.80 s / 9918 steps (MFU 30.5 %)", "v5p:2x2x4",
              18757.80 / 9918, _llama_flops(1024, 24, 16, 8, 3584, 128256, 4096), (24, 16, 1024, 4096, 128256), 256),
    Published("marin_1_2b", MARIN.format("1_2b") + ": 54527.10 s / 22888 steps (MFU 51.7 %)", "v5p:2x2x4",
              54527.10 / 22888, _llama_flops(2048, 16, 16, 8, 7168, 128256, 4096), (16, 16, 2048, 4096, 128256), 256),
    # MaxText first published 165 TFLOP/s (60 %) for this row (@cf466fa) and replaced it with 156 (56.7 %)
    Published("maxtext_22b_v4", "AI-Hypercomputer/maxtext@281e04b README 'Runtime Performance Results':"
              " '| 1x v4-128 | 156 | 56.7% |' (22B, configs/1xv4-128.sh: fsdp 64, 16 sequences of 1024 per chip,"
              " remat full); step = 6·N·T·B / 156 TFLOP/s = 13.82 s", "v4:4x4x4", 13.82,
              _maxtext_2023_flops(6144, 48, 24, 256, 24576, 32768, 1024), (48, 24, 6144, 1024, 32768), 1024),
    Published("maxtext_16b_v5e", "AI-Hypercomputer/maxtext@9bc243c README: '| 1x v5e-256 | 120 | 61.10% |'"
              " (16B, configs/largest_job/16b.sh: fsdp 256, 6 sequences of 2048 per chip, remat full); step ="
              " MaxText's FLOPs per device / 120.4 TFLOP/s = 10.63 s", "v5e:16x16", 10.63,
              _maxtext_2023_flops(5120, 32, 32, 256, 32768, 32768, 2048), (32, 25, 6400, 2048, 32768), 1536),
]


def run(entry: Published) -> dict:
    """Compiles (or reads back) the analog and returns its predicted step beside the measured one: with VMEM counted
    as planning/step_time.py does by default and as libtpu's own cost model counts it, and without this model's
    fixed costs (op overhead, collectives' latency); with the regime figures planning/backtest_band.py keys on."""
    program, mesh = compile_train_call(entry.config(), entry.topology)
    if program.error is not None:
        return {"name": entry.name, "topology": entry.topology, "error": program.error}
    chip, target = chip_of(entry.topology)[1], entry.target_s()
    estimate = functools.partial(estimate_hlo, program.hlo, chip, dict(mesh.shape), torus=torus(mesh))
    e, libtpu, bare = estimate(), estimate(libtpu_vmem=True), estimate(fixed_costs=False)
    return {"name": entry.name, "topology": entry.topology, "measured_s": entry.measured_s, "target_s": target,
            "predicted_s": e.predicted_s, "ratio": e.predicted_s / target,
            "predicted_libtpu_vmem_s": libtpu.predicted_s, "ratio_libtpu_vmem": libtpu.predicted_s / target,
            "predicted_without_fixed_costs_s": bare.predicted_s, "compute_s": e.compute_s,
            "exposed_share": e.exposed_share, "fixed_s": e.fixed_s, "ops": e.ops, "op_overhead_s": OP_OVERHEAD_S,
            "source": entry.source}


def fit_op_overhead(rows: list[dict], grid=tuple(i * 0.25e-6 for i in range(201))) -> float:
    """The per-op fixed cost (0–50 µs) that minimizes the squared log error of the rows' predictions."""
    def error(overhead: float) -> float:
        return sum(math.log(r["target_s"] / (r["predicted_s"] + r["ops"] * (overhead - r["op_overhead_s"]))) ** 2
                   for r in rows if "ratio" in r)

    return min(grid, key=error)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--entries", nargs="+", choices=[e.name for e in ENTRIES], default=[e.name for e in ENTRIES])
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    rows = []
    print(f"{'entry':<16} {'topology':<10} {'measured':>9} {'target':>8} {'predicted':>9} {'ratio':>6}"
          f"  {'libtpu VMEM':>11} {'ratio':>6}  {'no fixed':>9}  {'compute':>8} {'exposed':>7}")
    for entry in ENTRIES:
        if entry.name in args.entries:
            r = run(entry)
            rows.append(r)
            if "ratio" not in r:
                print(f"{r['name']:<16} {r['topology']:<10} does not compile: {r['error']}", flush=True)
                continue
            print(f"{r['name']:<16} {r['topology']:<10} {r['measured_s']:8.3f}s {r['target_s']:7.3f}s"
                  f" {r['predicted_s']:8.3f}s {r['ratio']:6.2f}  {r['predicted_libtpu_vmem_s']:10.3f}s"
                  f" {r['ratio_libtpu_vmem']:6.2f}  {r['predicted_without_fixed_costs_s']:8.3f}s"
                  f"  {r['compute_s'] * 1e3:6.0f}ms {r['exposed_share']:7.1%}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    if len(rows) > 1:
        print(f"the per-op fixed cost these rows fit best: {fit_op_overhead(rows) * 1e6:.2f} µs"
              f" (planning/step_time.py's OP_OVERHEAD_S is {OP_OVERHEAD_S * 1e6:.2f} µs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
