"""The GPU check, in one command on a machine with one CUDA GPU: cuDNN's packed-document attention against XLA's,
the benchmark of the train call beside nanoGPT's, and the run a user starts, side by side.

    python -m benchmarks.gpu_check                          # ~5-8 minutes on an H100
    python -m benchmarks.gpu_check --nanogpt ~/nanoGPT      # with nanoGPT's bench.py beside ours

1. Attention: `gpt2/cudnn.py`'s packed segments (what `model.attention=auto` uses for document masking from Hopper
   on) and cuDNN with a dense mask, each against XLA's attention on bfloat16 rows holding several documents: the
   output and the gradients of q, k and v, as relative errors (bfloat16 keeps ~3 significant digits; each must be
   under 2e-2).
2. The benchmark: `benchmarks.gpu_vs_nanogpt` at --batch rows of 1024 tokens (cuDNN attention; nanoGPT too with
   --nanogpt), median seconds per step after warm-up.
3. The run: `python train.py --config gpt2_124m` on the Shakespeare corpus prepared here (document masking on, as
   the preset has it), --train.batch_size=--batch, --train.grad_accum=1, --steps steps; its own logged
   tokens_per_s over the second half of the steps.

It prints a table and exits non-zero if an attention check fails; --json keeps the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 2e-2  # relative error, bfloat16 inputs (8 bits of mantissa: 4e-3 per rounding)


def attention_errors(B: int = 4, T: int = 1024, H: int = 12, K: int = 64, seed: int = 0) -> dict:
    """Relative errors of cuDNN's packed and dense-mask attention against XLA's, forward and q/k/v gradients."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from gpt2 import cudnn
    from gpt2.layers import _same_segment
    from gpt2.model import EOT, documents

    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.bfloat16) for _ in range(3))
    ids = rng.integers(0, 50000, (B, T))
    ids[rng.random((B, T)) < 6 / T] = EOT  # about 6 documents a row
    ids[0, 0] = EOT
    segments, _ = documents(jnp.asarray(ids))
    scale = 1 / np.sqrt(K)

    def xla(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=_same_segment(segments), is_causal=True, scale=scale,
                                            implementation="xla")

    def dense(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=_same_segment(segments), is_causal=True, scale=scale,
                                            implementation="cudnn")

    def packed(q, k, v):
        return cudnn.packed_attention(q, k, v, segments, scale=scale)

    cotangent = jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.bfloat16)

    def outputs(f):
        out, vjp = jax.vjp(jax.jit(f), q, k, v)
        return [out, *vjp(cotangent)]

    def rel(a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    reference = outputs(xla)
    errors = {}
    for name, f in (("packed", packed), ("dense", dense)):
        try:
            errors[name] = dict(zip(("out", "dq", "dk", "dv"), (rel(a, b) for a, b in zip(outputs(f), reference))))
        except Exception as e:  # noqa: BLE001 - e.g. packed segments before Hopper: reported, not fatal
            errors[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    return errors


def bench(batch: int, nanogpt: str | None, timeout: int) -> dict:
    """benchmarks.gpu_vs_nanogpt's rows (cuDNN attention, and nanoGPT's bench.py when given) at `batch`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        args = ["--batch", str(batch), "--attention", "cudnn", "--json", str(out), "--timeout", str(timeout)]
        subprocess.run([sys.executable, "-m", "benchmarks.gpu_vs_nanogpt", *args,
                        *(["--nanogpt", nanogpt] if nanogpt else [])], cwd=ROOT, check=True)
        return json.loads(out.read_text())


def real_run(batch: int, steps: int, work: Path) -> dict:
    """`train.py --config gpt2_124m` on the prepared Shakespeare corpus: its logged tokens/s over the second half."""
    corpus, run_dir = work / "shakespeare", work / "run"
    subprocess.run([sys.executable, "-m", "data.prepare", "--source", "data/assets/shakespeare.jsonl.xz",
                    "--out_dir", str(corpus), "--val_fraction", "0.1"], cwd=ROOT, check=True, capture_output=True)
    command = [sys.executable, "train.py", "--config", "gpt2_124m", f"--data.dataset={corpus}",
               f"--train.batch_size={batch}", "--train.grad_accum=1", f"--train.steps={steps}",
               f"--run_dir={run_dir}", "--log.wandb=disabled", "--log.progress=False"]
    subprocess.run(command, cwd=ROOT, check=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_s"] for r in records if r.get("tokens_per_s") and r["step"] > steps // 2]
    mfus = [r["mfu"] for r in records if r.get("mfu") and r["step"] > steps // 2]
    return {"command": " ".join(command[1:]), "tokens_per_s": statistics.median(speeds),
            "mfu": statistics.median(mfus)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nanogpt", default=None, help="a checkout of karpathy/nanoGPT (bench.py) to run beside ours")
    p.add_argument("--batch", type=int, default=32, help="sequences of 1024 tokens per step, bench and run alike")
    p.add_argument("--steps", type=int, default=60, help="the run's optimizer steps")
    p.add_argument("--timeout", type=int, default=600, help="seconds for each benchmark row")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    errors = attention_errors()
    for name, figures in errors.items():
        print(f"attention {name:6s} vs xla: " + ", ".join(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}"
                                                          for k, v in figures.items()), flush=True)
    failed = [name for name, f in errors.items() if "error" not in f and max(f.values()) > TOLERANCE]
    rows = bench(args.batch, args.nanogpt, args.timeout)
    with tempfile.TemporaryDirectory() as tmp:
        run = real_run(args.batch, args.steps, Path(tmp))
    measured = [r for r in rows["rows"] if "error" not in r]
    ours = next(r for r in measured if r["label"] == "ours, attention=cudnn")
    print(f"\n{'what':40s} {'tokens/s':>12s} {'MFU':>7s}")
    for r in measured:
        print(f"{'bench: ' + r['label']:40s} {r['tokens_per_s']:12,.0f} {r.get('mfu_6n_full', float('nan')):7.1%}")
    print(f"{'python train.py --config gpt2_124m':40s} {run['tokens_per_s']:12,.0f} {run['mfu']:7.1%}")
    print(f"the run at {run['tokens_per_s'] / ours['tokens_per_s']:.1%} of the bench's tokens/s (goal >= 90 %)")
    if args.json:
        Path(args.json).write_text(json.dumps({"attention": errors, "bench": rows, "run": run}, indent=2))
    if failed:
        print(f"FAILED: {', '.join(failed)} attention differs from XLA's by more than {TOLERANCE}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
