"""Throughput of our train call against Hugging Face transformers + torch and the machine's matmul peak.

    python -m benchmarks.train_step                    # the CPU smoke shape, K = 1 and 16
    python -m benchmarks.train_step --shape 124m --remat full --attention-query-blocks 4 --k 1 --repeats 3
    python -m benchmarks.train_step --json out.json
    python -m benchmarks.train_step --no-keep-freed-memory   # glibc's malloc defaults (see trainer/malloc.py)

Everything is measured in this one process, on the same threads, so the ratios hold even though absolute
speeds on a shared machine drift. Warm-up (compilation) runs are excluded; each figure is the median of
`--repeats` timed runs, with min and max.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from configs.base import CheckpointConfig, Config, TrainConfig
from optim.schedules import CosineSchedule
from data.loader import LoaderConfig, make_dataset
from data.prepare import prepare_shakespeare
from gpt2 import GPT2Config
from trainer.program.mesh import make_mesh
from gpt2.config import RematPolicy
from trainer.hardware import measure_matmul_peak
from trainer.malloc import keep_freed_memory
from trainer.program.train_program import TrainProgram
from trainer.storage.checkpoints import Checkpoints

SHAPES = {
    # issue 6's CPU smoke shape and GPT-2 124M
    "smoke": dict(model=dict(n_layer=4, n_head=4, n_embd=128, block_size=64), batch=12, seq=64),
    "124m": dict(model=dict(n_layer=12, n_head=12, n_embd=768, block_size=1024), batch=1, seq=1024),
}


def timed(fn, repeats: int) -> dict:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def torch_matmul_peak(dtype: str, n: int = 2048, repeats: int = 5) -> float:
    """The same square matmul through torch (MKL / oneDNN): what this CPU does outside XLA."""
    import torch

    a = torch.ones((n, n), dtype=getattr(torch, dtype))
    a @ a
    return 2 * n**3 / timed(lambda: a @ a, repeats)["min_s"]


def config_for(shape: str, k: int, **model_kw) -> Config:
    s = SHAPES[shape]
    model = GPT2Config(**{**s["model"], **model_kw})
    return Config(model=model, train=TrainConfig(batch_size=s["batch"], seq_len=s["seq"], steps_per_call=k,
                                                 steps=10_000), schedule=CosineSchedule(warmup_steps=10))


def ours(cfg: Config, repeats: int) -> dict:
    """tokens/s of the real K-step train call (one device: the whole CPU)."""
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    trainer = TrainProgram.build(cfg, mesh)
    t = cfg.train
    batch = np.random.RandomState(0).randint(0, cfg.model.vocab_size, (t.steps_per_call, t.batch_size,
                                                                        t.seq_len + 1)).astype(np.int32)
    with jax.set_mesh(mesh):
        call = trainer.train_call()
        batch = jax.device_put(batch, trainer.batch_sharding)
        active = np.ones(t.steps_per_call, bool)
        state = [trainer.init_state()]
        started = time.perf_counter()
        state[0], m = call(state[0], batch, active)
        jax.block_until_ready(m)
        first = time.perf_counter() - started

        def run():
            state[0], m = call(state[0], batch, active)
            jax.block_until_ready(m)

        r = timed(run, repeats)
    tokens = t.steps_per_call * t.batch_size * t.seq_len
    return {**r, "tokens_per_s": tokens / r["median_s"], "first_call_s": first}


def theirs(cfg: Config, repeats: int) -> dict:
    """tokens/s of transformers' GPT2LMHeadModel + torch AdamW + clipping on the same shapes."""
    import torch
    from transformers import GPT2Config as HFConfig
    from transformers import GPT2LMHeadModel

    c, t = cfg.model, cfg.train
    torch.manual_seed(0)
    model = GPT2LMHeadModel(HFConfig(vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd,
                                     n_layer=c.n_layer, n_head=c.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    x = torch.randint(0, c.vocab_size, (t.batch_size, t.seq_len + 1))

    def step():
        loss = model(x[:, :-1], labels=x[:, :-1]).loss  # HF shifts labels internally
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    step()
    r = timed(step, repeats)
    return {**r, "tokens_per_s": t.batch_size * t.seq_len / r["median_s"], "torch_threads": torch.get_num_threads()}


def compile_seconds(config: GPT2Config, batch: int, seq: int) -> float:
    """Lower + compile of one train call on abstract inputs (nothing allocated)."""
    cfg = Config(model=config, train=TrainConfig(batch_size=batch, seq_len=seq, steps_per_call=1))
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    trainer = TrainProgram.build(cfg, mesh)
    started = time.perf_counter()
    with jax.set_mesh(mesh):
        trainer.lower().compile()
    return time.perf_counter() - started


def loader_tokens_per_s(seconds: float = 3.0) -> float:
    corpus = prepare_shakespeare(os.path.expanduser("~/.cache/gpt2_nnx/shakespeare"), quiet=True)
    cfg = LoaderConfig(seq_len=1024, batch_size=8, num_workers=0)
    it = iter(make_dataset([corpus / "train.bin"], 50257, cfg, shard_index=0, shard_count=1))
    next(it)
    n, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        n += next(it).size
    return n / (time.perf_counter() - started)


def checkpoint_blocking(cfg: Config, repeats: int = 3) -> dict:
    """How long `save` blocks the loop vs how long the asynchronous write takes in total."""
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    trainer = TrainProgram.build(cfg, mesh)
    with jax.set_mesh(mesh):
        state = trainer.init_state()
    blocked, total = [], []
    with tempfile.TemporaryDirectory() as d:
        ckpt = Checkpoints(d, CheckpointConfig(keep=2, async_save=True))
        for step in range(repeats + 1):
            started = time.perf_counter()
            ckpt.save(step, state, None, {"step": step})
            blocked.append(time.perf_counter() - started)
            ckpt.wait()
            total.append(time.perf_counter() - started)
        ckpt.close()
    blocked, total = blocked[1:], total[1:]  # the first save includes one-time set-up
    return {"blocked_s": statistics.median(blocked), "save_s": statistics.median(total),
            "blocked_fraction": statistics.median(blocked) / statistics.median(total)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="smoke")
    p.add_argument("--k", type=int, nargs="+", default=[1, 16], help="steps per call to measure")
    p.add_argument("--remat", default="none", choices=RematPolicy.__args__,
                   help="our model's remat policy (on CPU, full remat is the fastest at 124M: less memory traffic)")
    p.add_argument("--attention-query-blocks", type=int, default=1,
                   help="model.attention_query_blocks: skip the masked upper triangle of causal attention")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--skip", nargs="*", default=[], choices=["torch", "compile", "loader", "checkpoint"])
    p.add_argument("--no-keep-freed-memory", dest="keep_freed_memory", action="store_false",
                   help="leave glibc's malloc defaults (train.py does not; see trainer/malloc.py)")
    args = p.parse_args(argv)
    kept = keep_freed_memory() if args.keep_freed_memory else False

    results = {"shape": args.shape, **SHAPES[args.shape], "remat": args.remat,
               "attention_query_blocks": args.attention_query_blocks, "devices": str(jax.devices()[0].device_kind),
               "cpu_count": os.cpu_count(), "keep_freed_memory": kept}
    results["peak_flops_f32"] = measure_matmul_peak(dtype=jnp.float32)
    results["peak_flops_bf16"] = measure_matmul_peak(dtype=jnp.bfloat16)
    for k in args.k:
        results[f"ours_k{k}"] = ours(config_for(args.shape, k, remat=args.remat,
                                                attention_query_blocks=args.attention_query_blocks), args.repeats)
    if "torch" not in args.skip:
        results["torch_peak_flops_f32"] = torch_matmul_peak("float32")
        results["torch_peak_flops_bf16"] = torch_matmul_peak("bfloat16")
        results["transformers"] = theirs(config_for(args.shape, 1), args.repeats)
    if "compile" not in args.skip:
        s = SHAPES[args.shape]
        results["compile_s"] = {
            "scan": compile_seconds(config_for(args.shape, 1).model, s["batch"], s["seq"]),
            "loop": compile_seconds(config_for(args.shape, 1, scan_layers=False).model, s["batch"], s["seq"]),
            "gpt2_scan": compile_seconds(GPT2Config.gpt2(), 1, 128),
            "gpt2_xl_scan": compile_seconds(GPT2Config.gpt2_xl(), 1, 128),
        }
    if "loader" not in args.skip:
        results["loader_tokens_per_s"] = loader_tokens_per_s()
    if "checkpoint" not in args.skip:
        results["checkpoint"] = checkpoint_blocking(config_for(args.shape, 1))
    derive(results, config_for(args.shape, 1).model.flops_per_token(SHAPES[args.shape]["seq"]), args.k)
    print_table(results)
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def derive(results: dict, flops_per_token: float, ks: list[int]) -> dict:
    """Adds the figures computed from the measurements: MFUs, the ceiling, and every ratio."""
    r = results
    # Tokens/s if every model FLOP ran at XLA's best matmul rate: no XLA program of this model can beat it.
    r["ceiling_tokens_per_s"] = r["peak_flops_f32"] / flops_per_token
    for k in ks:
        r[f"ours_k{k}"]["mfu_vs_f32_peak"] = r[f"ours_k{k}"]["tokens_per_s"] * flops_per_token / r["peak_flops_f32"]
    if "transformers" in r:
        t = r["transformers"]
        t["mfu_vs_f32_peak"] = t["tokens_per_s"] * flops_per_token / r["peak_flops_f32"]
        t["mfu_vs_torch_f32_peak"] = t["tokens_per_s"] * flops_per_token / r["torch_peak_flops_f32"]
        for k in ks:
            r[f"ratio_ours_k{k}_vs_transformers"] = r[f"ours_k{k}"]["tokens_per_s"] / t["tokens_per_s"]
        r["ratio_ceiling_vs_transformers"] = r["ceiling_tokens_per_s"] / t["tokens_per_s"]
    if len(ks) > 1:
        r[f"ratio_k{ks[-1]}_vs_k{ks[0]}"] = r[f"ours_k{ks[-1]}"]["tokens_per_s"] / r[f"ours_k{ks[0]}"]["tokens_per_s"]
    if "compile_s" in r:
        r["compile_s"]["xl_vs_gpt2"] = r["compile_s"]["gpt2_xl_scan"] / r["compile_s"]["gpt2_scan"]
    return r


def print_table(r: dict) -> None:
    rows = [("matmul peak float32 (XLA)", f"{r['peak_flops_f32'] / 1e9:,.1f} GFLOP/s"),
            ("matmul peak bfloat16 (XLA)", f"{r['peak_flops_bf16'] / 1e9:,.1f} GFLOP/s")]
    if "torch_peak_flops_f32" in r:
        rows += [("matmul peak float32 (torch)", f"{r['torch_peak_flops_f32'] / 1e9:,.1f} GFLOP/s"),
                 ("matmul peak bfloat16 (torch)", f"{r['torch_peak_flops_bf16'] / 1e9:,.1f} GFLOP/s")]
    rows.append(("ceiling at XLA's float32 peak", f"{r['ceiling_tokens_per_s']:,.0f} tok/s"))
    for key, v in r.items():
        if key.startswith("ours_k"):
            rows.append((f"ours, K={key[6:]}", f"{v['tokens_per_s']:,.0f} tok/s (min {v['min_s']:.3f}s,"
                         f" median {v['median_s']:.3f}s, max {v['max_s']:.3f}s)  MFU {v['mfu_vs_f32_peak']:.1%}"))
    if "transformers" in r:
        v = r["transformers"]
        rows.append(("transformers + torch AdamW", f"{v['tokens_per_s']:,.0f} tok/s ({v['torch_threads']} threads)"
                     f"  MFU {v['mfu_vs_f32_peak']:.1%} of XLA's peak, {v['mfu_vs_torch_f32_peak']:.1%} of torch's"))
    rows += [(k.replace("_", " "), f"{v:.2f}x") for k, v in r.items() if k.startswith("ratio")]
    if "compile_s" in r:
        rows += [(f"compile {k}", f"{v:.1f} s" if k != "xl_vs_gpt2" else f"{v:.2f}x")
                 for k, v in r["compile_s"].items()]
    if "loader_tokens_per_s" in r:
        rows.append(("Grain loader, 0 workers", f"{r['loader_tokens_per_s'] / 1e6:.1f} M tok/s"))
    if "checkpoint" in r:
        c = r["checkpoint"]
        rows.append(("async checkpoint save", f"blocks {c['blocked_s'] * 1e3:.0f} ms of {c['save_s'] * 1e3:.0f} ms"
                     f" ({c['blocked_fraction']:.0%})"))
    width = max(len(a) for a, _ in rows)
    for a, b in rows:
        print(f"{a.ljust(width)}  {b}")


if __name__ == "__main__":
    main()
