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
import json

import configs
from configs.base import Config
from configs.cli import parse
from planning.aot import chip_of, compile_train_call
from planning.step_time import estimate_hlo


@dataclasses.dataclass(frozen=True)
class Published:
    """A measured step and what it takes to compile its analog."""

    name: str
    source: str  # where the figure is published, and the quote or derivation
    topology: str
    measured_s: float  # the source's step time
    source_flops_per_token: float  # 6N + 12·L·T·attention width (non-causal), the source's own architecture
    model: tuple[int, int, int, int, int]  # the analog's n_layer, n_head, n_embd, seq_len, vocab
    batch: int  # global sequences per step

    def flags(self) -> list[str]:
        layers, heads, width, seq, vocab = self.model
        return [f"--model.n_layer={layers}", f"--model.n_head={heads}", f"--model.n_embd={width}",
                f"--model.block_size={seq}", f"--model.vocab_size={vocab}", "--model.pad_vocab_to=128",
                "--model.scan_layers=true", "--model.remat=full", "--model.document_mask=false",
                "--model.document_positions=false", f"--train.seq_len={seq}", f"--train.batch_size={self.batch}",
                "--train.grad_accum=1", "--train.steps_per_call=1", "--mesh.data=1", "--mesh.fsdp=-1",
                "--mesh.tensor=1", "--mesh.rules=fsdp", "--guard.skip_spikes=false"]

    def config(self) -> Config:
        return parse(Config, self.flags(), default=configs.load("gpt2_124m"), prog="backtest")

    def target_s(self) -> float:
        """The analog's step at the source's measured MFU."""
        t = self.config().train
        return self.measured_s * self.config().model.flops_per_token(t.seq_len) / self.source_flops_per_token


def _llama_flops(d: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int) -> float:
    """6N + 12·L·T·d per token of a Llama-style decoder (SwiGLU, GQA, untied head); N: its matmul weights."""
    hd = d // heads
    n = layers * (2 * d * heads * hd + 2 * d * kv_heads * hd + 3 * d * ffn) + vocab * d
    return 6 * n + 12 * layers * seq * heads * hd


def _maxtext_2023_flops(d: int, layers: int, heads: int, head_dim: int, mlp: int, vocab: int, seq: int) -> float:
    """MaxText's 2023 decoder (ReLU MLP, tied head): 6N + 12·L·T·heads·head_dim per token."""
    n = layers * (4 * d * heads * head_dim + 2 * d * mlp) + vocab * d
    return 6 * n + 12 * layers * seq * heads * head_dim


TPU_RECIPES = "AI-Hypercomputer/tpu-recipes@d95a9dc training/trillium/Llama3.1-8B-MaxText/v6e-8/README.md"
MARIN = ("marin-community/marin@75d9c2c7 experiments/speedrun/adamw_llama_scaling/{}/speedrun_results.json:"
         " training_time / num_train_steps (Levanter's per-step durations over the whole run), 16 chips")
ENTRIES = [
    Published("llama3_8b_v6e8", f"{TPU_RECIPES}: 'completed step: 14, seconds: 3.443, TFLOP/s/device: 413.433'"
              " (MFU 45.0 %); 3 sequences of 8192 per chip, FSDP 8", "v6e:2x4", 3.443,
              _llama_flops(4096, 32, 32, 8, 14336, 128256, 8192), (32, 32, 4096, 8192, 50304), 24),
    Published("marin_300m", MARIN.format("300m") + ": 5250.40 s / 11444 steps (MFU 25.8 %)", "v5p:2x2x4",
              5250.40 / 11444, _llama_flops(768, 12, 12, 12, 2688, 128256, 4096), (12, 12, 768, 4096, 128256), 128),
    Published("marin_520m", MARIN.format("520m") + ": 18757.80 s / 9918 steps (MFU 30.5 %)", "v5p:2x2x4",
              18757.80 / 9918, _llama_flops(1024, 24, 16, 8, 3584, 128256, 4096), (24, 16, 1024, 4096, 128256), 256),
    Published("marin_1_2b", MARIN.format("1_2b") + ": 54527.10 s / 22888 steps (MFU 51.7 %)", "v5p:2x2x4",
              54527.10 / 22888, _llama_flops(2048, 16, 16, 8, 7168, 128256, 4096), (16, 16, 2048, 4096, 128256), 256),
    Published("maxtext_22b_v4", "AI-Hypercomputer/maxtext@cf466fa README 'Runtime Performance Results':"
              " '| 1x v4-128 | 165 | 60% |' (22B, configs/1xv4-128.sh: fsdp 64, 16 sequences of 1024 per chip);"
              " step = 6·N·T·B / 165 TFLOP/s = 13.07 s", "v4:4x4x4", 13.07,
              _maxtext_2023_flops(6144, 48, 24, 256, 24576, 32768, 1024), (48, 24, 6144, 1024, 32768), 1024),
    Published("maxtext_16b_v5e", "AI-Hypercomputer/maxtext@9bc243c README: '| 1x v5e-256 | 120 | 61.10% |'"
              " (16B, configs/largest_job/16b.sh: fsdp 256, 6 sequences of 2048 per chip); step = MaxText's"
              " FLOPs per device / 120.4 TFLOP/s = 10.63 s", "v5e:16x16", 10.63,
              _maxtext_2023_flops(5120, 32, 32, 256, 32768, 32768, 2048), (32, 25, 6400, 2048, 32768), 1536),
]


def run(entry: Published) -> dict:
    """Compiles (or reads back) the analog and returns its predicted step beside the measured one, with VMEM
    counted as planning/step_time.py does by default and as libtpu's own cost model counts it."""
    program, mesh = compile_train_call(entry.config(), entry.topology)
    if program.error is not None:
        return {"name": entry.name, "topology": entry.topology, "error": program.error}
    chip, target = chip_of(entry.topology)[1], entry.target_s()
    predicted = {vmem: estimate_hlo(program.hlo, chip, dict(mesh.shape), libtpu_vmem=vmem).predicted_s
                 for vmem in (False, True)}
    return {"name": entry.name, "topology": entry.topology, "measured_s": entry.measured_s, "target_s": target,
            "predicted_s": predicted[False], "ratio": predicted[False] / target,
            "predicted_libtpu_vmem_s": predicted[True], "ratio_libtpu_vmem": predicted[True] / target,
            "source": entry.source}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--entries", nargs="+", choices=[e.name for e in ENTRIES], default=[e.name for e in ENTRIES])
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    rows = []
    print(f"{'entry':<16} {'topology':<10} {'measured':>9} {'target':>8} {'predicted':>9} {'ratio':>6}"
          f"  {'libtpu VMEM':>11} {'ratio':>6}")
    for entry in ENTRIES:
        if entry.name in args.entries:
            r = run(entry)
            rows.append(r)
            if "ratio" not in r:
                print(f"{r['name']:<16} {r['topology']:<10} does not compile: {r['error']}", flush=True)
                continue
            print(f"{r['name']:<16} {r['topology']:<10} {r['measured_s']:8.3f}s {r['target_s']:7.3f}s"
                  f" {r['predicted_s']:8.3f}s {r['ratio']:6.2f}  {r['predicted_libtpu_vmem_s']:10.3f}s"
                  f" {r['ratio_libtpu_vmem']:6.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
