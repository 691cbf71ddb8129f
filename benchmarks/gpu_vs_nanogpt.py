"""Our GPT-2 124M train call on a GPU beside nanoGPT's own `bench.py` (torch.compile), same shape, one command.

    python -m benchmarks.gpu_vs_nanogpt --nanogpt ~/nanoGPT            # on a CUDA machine
    python -m benchmarks.gpu_vs_nanogpt --nanogpt ~/nanoGPT --json out.json

The shape is bench.py's: 12 sequences of 1024 tokens per step, GPT-2 124M with biases (`--bias=True`, as GPT-2),
the vocabulary padded to 50,304, no dropout, random tokens, bfloat16 compute with float32 parameters (torch's
autocast), AdamW. Ours runs `steps_per_call` optimizer steps per jitted call (this project's default) with
`--model.attention=cudnn` and `xla`. Each measurement runs in its own process, so each framework has the GPU to
itself; the figures are medians of timed calls after warm-up (compilation excluded).

MFU is printed in both conventions: 6N + non-causal attention (PaLM, nanoGPT's `estimate_mfu`, this project) and
6N + causal attention (MaxText, llm.c). Both use the same FLOPs per token for nanoGPT and ours, so their ratio is
the tokens/s ratio; nanoGPT's own printed MFU is against an A100's 312 TFLOP/s and is not used.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time

BATCH, SEQ = 12, 1024


def model_config(attention: str):
    from gpt2 import GPT2Config

    return GPT2Config.gpt2(pad_vocab_to=128, dtype="bfloat16", param_dtype="float32", attention=attention,
                           remat="none", scan_layers=False, dropout=0.0, document_mask=False,
                           document_positions=False)


def ours(attention: str, k: int, calls: int) -> dict:
    """tokens/s of our jitted K-step train call, on one GPU."""
    import jax
    import numpy as np

    from configs.base import Config, OptimConfig, TrainConfig
    from trainer.program.mesh import make_mesh
    from trainer.program.train_program import TrainProgram

    cfg = Config(model=model_config(attention), train=TrainConfig(batch_size=BATCH, seq_len=SEQ, steps_per_call=k,
                                                                  steps=100_000),
                 optim=OptimConfig(lr=1e-4, warmup_steps=10, weight_decay=1e-2))
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    program = TrainProgram.build(cfg, mesh)
    tokens = np.random.RandomState(0).randint(0, 50257, (k, BATCH, SEQ + 1)).astype(np.int32)
    with jax.set_mesh(mesh):
        call = program.train_call()
        batch = jax.device_put(tokens, program.batch_sharding)
        active = np.ones(k, bool)
        state = program.init_state()
        times = []
        for i in range(calls + 2):  # two warm-up calls: compilation, then the first donated-buffer call
            started = time.perf_counter()
            state, metrics = call(state, batch, active)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - started)
    step_s = statistics.median(times[2:]) / k
    return {"step_s": step_s, "tokens_per_s": BATCH * SEQ / step_s, "device": jax.devices()[0].device_kind,
            "loss": float(np.asarray(metrics["loss"]).reshape(-1)[-1])}


def nanogpt(path: str) -> dict:
    """nanoGPT's bench.py as its README runs it, on random data with GPT-2's biases; its own timing loop."""
    cmd = [sys.executable, "bench.py", "--real_data=False", "--bias=True", f"--batch_size={BATCH}",
           f"--block_size={SEQ}", "--compile=True"]
    out = subprocess.run(cmd, cwd=path, capture_output=True, text=True, timeout=900)
    found = re.search(r"time per iteration: ([\d.]+)ms", out.stdout)
    if out.returncode != 0 or not found:
        return {"error": (out.stderr or out.stdout)[-2000:]}
    step_s = float(found.group(1)) / 1000
    return {"step_s": step_s, "tokens_per_s": BATCH * SEQ / step_s, "command": " ".join(cmd)}


def child(args) -> None:
    """One measurement in this process; prints one JSON line."""
    r = nanogpt(args.nanogpt) if args.only == "nanogpt" else ours(args.only, args.k, args.calls)
    print("RESULT " + json.dumps(r), flush=True)


def measure(name: str, args) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.gpu_vs_nanogpt", "--only", name, "--k", str(args.k),
           "--calls", str(args.calls), "--nanogpt", args.nanogpt or ""]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        return {"error": (out.stderr or out.stdout)[-2000:]}
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nanogpt", default=None, help="a checkout of karpathy/nanoGPT (bench.py, model.py)")
    p.add_argument("--k", type=int, default=10, help="our optimizer steps per jitted call")
    p.add_argument("--calls", type=int, default=5, help="our timed calls (after two warm-up calls)")
    p.add_argument("--only", default=None, choices=["cudnn", "xla", "nanogpt"], help=argparse.SUPPRESS)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.only:
        child(args)
        return 0
    rows = {name: measure(name, args) for name in ["cudnn", "xla"] + (["nanogpt"] if args.nanogpt else [])}
    import jax

    from trainer.hardware import peak_flops_per_device

    device, peak = jax.devices()[0].device_kind, peak_flops_per_device(None)
    print(f"GPT-2 124M, {BATCH}x{SEQ} tokens per step, bf16 compute, on {device} (peak {peak / 1e12:.0f} TFLOP/s)")
    print(f"{'':<22} {'ms/step':>8} {'tokens/s':>10} {'MFU 6N+full':>12} {'MFU 6N+causal':>14}")
    for name, r in rows.items():
        label = {"cudnn": "ours, attention=cudnn", "xla": "ours, attention=xla", "nanogpt": "nanoGPT bench.py"}[name]
        if "error" in r:
            print(f"{label:<22} failed: {r['error'].strip().splitlines()[-1] if r['error'].strip() else '?'}")
            continue
        mfu = [r["tokens_per_s"] * model_config("xla").flops_per_token(SEQ, causal=c) / peak for c in (False, True)]
        r.update(mfu_6n_full=mfu[0], mfu_6n_causal=mfu[1])
        print(f"{label:<22} {r['step_s'] * 1e3:8.1f} {r['tokens_per_s']:10,.0f} {mfu[0]:11.1%} {mfu[1]:13.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "peak_flops": peak, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
