"""Our GPT-2 124M train call on a GPU beside nanoGPT's own `bench.py` (torch.compile), same shape, one command.

    python -m benchmarks.gpu_vs_nanogpt --nanogpt ~/nanoGPT            # on a CUDA machine
    python -m benchmarks.gpu_vs_nanogpt --nanogpt ~/nanoGPT --batch 12 32 64 --attention cudnn   # batch scaling
    python -m benchmarks.gpu_vs_nanogpt --attention cudnn --xla-flags=--xla_gpu_enable_cublaslt=true   # a flag's row
    python -m benchmarks.gpu_vs_nanogpt --nanogpt ~/nanoGPT --json out.json

The shape is bench.py's: 12 sequences of 1024 tokens per step (`--batch` runs both at other batches too), GPT-2
124M with biases (`--bias=True`, as GPT-2), the vocabulary padded to 50,304, no dropout, random tokens, bfloat16
compute with float32 parameters (torch's autocast), AdamW. Ours runs `steps_per_call` optimizer steps per jitted
call (this project's default) with `--model.attention=cudnn` and `xla`; `--xla-flags` adds rows of ours (cuDNN
attention) under those XLA_FLAGS. Each row runs in its own process, so each framework and setting has the GPU to
itself; the figures are medians of timed calls after warm-up (compilation excluded).

MFU is printed in both conventions: 6N + non-causal attention (PaLM, nanoGPT's `estimate_mfu`, this project) and
6N + causal attention (MaxText, llm.c). Both use the same FLOPs per token for nanoGPT and ours, so their ratio is
the tokens/s ratio; nanoGPT's own printed MFU is against an A100's 312 TFLOP/s and is not used.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import time

SEQ = 1024
NANOGPT_BATCH = 12  # bench.py's default


def model_config(attention: str):
    from gpt2 import GPT2Config

    return GPT2Config.gpt2(pad_vocab_to=128, dtype="bfloat16", param_dtype="float32", attention=attention,
                           remat="none", scan_layers=False, dropout=0.0, document_mask=False,
                           document_positions=False)


def ours(attention: str, batch: int, k: int, calls: int, profile: str | None = None) -> dict:
    """tokens/s of our jitted K-step train call, on one GPU; with `profile` (a folder), where one call's time goes."""
    import jax
    import numpy as np

    from configs.base import Config, TrainConfig
    from optim.adamw import AdamWConfig
    from optim.schedules import CosineSchedule
    from trainer.program.mesh import make_mesh
    from trainer.program.train_program import TrainProgram

    cfg = Config(model=model_config(attention), train=TrainConfig(batch_size=batch, seq_len=SEQ, steps_per_call=k,
                                                                  steps=100_000),
                 optim=AdamWConfig(lr=1e-4, weight_decay=1e-2), schedule=CosineSchedule(warmup_steps=10))
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    program = TrainProgram.build(cfg, mesh)
    tokens = np.random.RandomState(0).randint(0, 50257, (k, batch, SEQ + 1)).astype(np.int32)
    with jax.set_mesh(mesh):
        call = program.train_call()
        rows = jax.device_put(tokens, program.batch_sharding)
        active = np.ones(k, bool)
        state = program.init_state()
        times = []
        for i in range(calls + 2):  # two warm-up calls: compilation, then the first donated-buffer call
            started = time.perf_counter()
            state, metrics = call(state, rows, active)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - started)
        if profile:  # one more call, traced after the timed ones so the trace does not slow them
            with jax.profiler.trace(profile):
                state, metrics = call(state, rows, active)
                jax.block_until_ready(metrics)
    from trainer.hardware import peak_flops_per_device

    step_s = statistics.median(times[2:]) / k
    r = {"step_s": step_s, "tokens_per_s": batch * SEQ / step_s, "device": jax.devices()[0].device_kind,
         "peak_flops": peak_flops_per_device(None), "loss": float(np.asarray(metrics["loss"]).reshape(-1)[-1])}
    traces = sorted(glob.glob(os.path.join(profile, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime) \
        if profile else []
    if traces:
        r["kernel_ms_per_step"] = {kind: ns / 1e6 / k for kind, ns in kernel_time(traces[-1]).most_common()}
    return r


def kernel_kind(kernel: str) -> str:
    """What a GPU kernel of ours is, by its name: cuDNN's attention, a matmul (cuBLAS's, or an XLA GEMM fusion),
    or one of XLA's other fusions (elementwise work and reductions: memory-bound on this model)."""
    if "sdpa" in kernel or "cudnn" in kernel:
        return "attention (cuDNN)"
    if kernel.startswith("nvjet") or "gemm" in kernel:
        return "matmuls"
    if "fusion" in kernel or kernel.startswith("wrapped_"):
        return "XLA fusions"
    return "other (copies, memsets)"


def kernel_time(xplane: str) -> collections.Counter:
    """Nanoseconds of GPU kernel time by `kernel_kind`, summed over every stream of a jax.profiler trace."""
    from jax.profiler import ProfileData

    by_kind = collections.Counter()
    for plane in ProfileData.from_file(xplane).planes:
        if plane.name.startswith("/device:GPU"):
            for line in (line for line in plane.lines if line.name.startswith("Stream")):
                for event in line.events:
                    by_kind[kernel_kind(event.name)] += event.duration_ns
    return by_kind


def nanogpt(path: str, batch: int, timeout: int) -> dict:
    """nanoGPT's bench.py as its README runs it, on random data with GPT-2's biases; its own timing loop."""
    cmd = [sys.executable, "bench.py", "--real_data=False", "--bias=True", f"--batch_size={batch}",
           f"--block_size={SEQ}", "--compile=True"]
    limit = max(timeout - 30, 1)  # inside the row's own, so that bench.py never outlives its row and holds the GPU
    try:
        out = subprocess.run(cmd, cwd=path, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return {"error": f"bench.py gave no result within {limit} s"}
    found = re.search(r"time per iteration: ([\d.]+)ms", out.stdout)
    if out.returncode != 0 or not found:
        return {"error": (out.stderr or out.stdout)[-2000:]}
    step_s = float(found.group(1)) / 1000
    return {"step_s": step_s, "tokens_per_s": batch * SEQ / step_s, "command": " ".join(cmd)}


def child(args) -> None:
    """One measurement in this process; prints one JSON line."""
    if args.only == "nanogpt":
        r = nanogpt(args.nanogpt, args.batch[0], args.timeout)
    else:
        r = ours(args.only, args.batch[0], args.k, args.calls, args.profile)
    print("RESULT " + json.dumps(r), flush=True)


def measure(name: str, batch: int, args, xla_flags: str | None = None) -> dict:
    """One row in its own process, so that each framework and setting has the GPU (and XLA_FLAGS) to itself."""
    cmd = [sys.executable, "-m", "benchmarks.gpu_vs_nanogpt", "--only", name, "--batch", str(batch),
           "--k", str(args.k), "--calls", str(args.calls), "--nanogpt", args.nanogpt or ""]
    if args.profile and name != "nanogpt":
        cmd += ["--profile", os.path.join(args.profile, f"{name}_b{batch}" + re.sub(r"\W+", "_", xla_flags or ""))]
    env = dict(os.environ)
    if xla_flags:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + xla_flags).strip()
    started = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within --timeout {args.timeout} s"}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        return {"error": (out.stderr or out.stdout)[-2000:]}
    return dict(json.loads(lines[-1][len("RESULT "):]), wall_s=round(time.perf_counter() - started, 1))


def plan_rows(args) -> list[tuple[str, str, int, str | None]]:
    """(label, child, batch, XLA_FLAGS) for every row, bench.py's shape first so a cut-short run still compares."""
    rows = []
    for batch in sorted(args.batch, key=lambda b: b != NANOGPT_BATCH):
        rows += [(f"ours, attention={a}", a, batch, None) for a in args.attention]
        rows += [("nanoGPT bench.py", "nanogpt", batch, None)] if args.nanogpt else []
        rows += [(f"ours, cudnn, {f}", "cudnn", batch, f) for f in args.xla_flags]
    return rows


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nanogpt", default=None, help="a checkout of karpathy/nanoGPT (bench.py, model.py)")
    p.add_argument("--batch", type=int, nargs="+", default=[NANOGPT_BATCH], help="sequences of 1024 per step")
    p.add_argument("--attention", nargs="+", default=["cudnn", "xla"], choices=["cudnn", "xla"])
    p.add_argument("--xla-flags", action="append", default=[],
                   help="an extra row of ours (cudnn) under these XLA_FLAGS; repeat for more rows. Give it with '=', "
                        "as its value starts with '--': --xla-flags=--xla_gpu_enable_cublaslt=true")
    p.add_argument("--k", type=int, default=10, help="our optimizer steps per jitted call")
    p.add_argument("--calls", type=int, default=5, help="our timed calls (after two warm-up calls)")
    p.add_argument("--profile", default=None, help="a folder: trace one more call of each row of ours there and "
                   "print its GPU kernel time by kind (matmuls, attention, XLA fusions)")
    p.add_argument("--timeout", type=int, default=900, help="seconds for each row's process")
    p.add_argument("--only", default=None, choices=["cudnn", "xla", "nanogpt"], help=argparse.SUPPRESS)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.only:
        child(args)
        return 0
    # No JAX in this process: a GPU context here would hold the device's memory while the rows run.
    rows = plan_rows(args)
    width = max(len(label) for label, *_ in rows)
    print(f"GPT-2 124M, sequences of {SEQ} tokens, bf16 compute; MFU against the device's peak (the first row's)")
    print(f"{'':<{width}} {'batch':>5} {'ms/step':>8} {'tokens/s':>10} {'MFU 6N+full':>12} {'MFU 6N+causal':>14}",
          flush=True)
    flops = model_config("xla").flops_per_token
    results, device, peak = [], None, None
    for label, name, batch, flags in rows:
        r = dict(measure(name, batch, args, flags), label=label, batch=batch, xla_flags=flags)
        results.append(r)
        device, peak = device or r.get("device"), peak or r.get("peak_flops")
        if args.json:  # after every row: a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"device": device, "peak_flops": peak, "rows": results}, f, indent=2)
        if "error" in r:
            last = r["error"].strip().splitlines()[-1] if r["error"].strip() else "?"
            print(f"{label:<{width}} {batch:5d} failed: {last}", flush=True)
            continue
        if peak:
            r.update(mfu_6n_full=r["tokens_per_s"] * flops(SEQ, causal=False) / peak,
                     mfu_6n_causal=r["tokens_per_s"] * flops(SEQ, causal=True) / peak)
        mfu = f"{r['mfu_6n_full']:11.1%} {r['mfu_6n_causal']:13.1%}" if peak else f"{'?':>11} {'?':>13}"
        print(f"{label:<{width}} {batch:5d} {r['step_s'] * 1e3:8.1f} {r['tokens_per_s']:10,.0f} {mfu}", flush=True)
        for kind, ms in r.get("kernel_ms_per_step", {}).items():
            print(f"    {kind:<30} {ms:8.2f} ms/step", flush=True)
    print(f"on {device} (peak {peak / 1e12:.0f} TFLOP/s)" if peak else "no row of ours ran: MFU unknown")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
