"""Throughput and memory of `python -m data.prepare` against tiktoken's own batch encoder on the same text.

    python -m benchmarks.prepare_corpus                    # 50M, 500M and 2G of synthetic JSON lines
    python -m benchmarks.prepare_corpus --sizes 50M,500M --dir /scratch

For each size: a synthetic .jsonl (documents of 100-3000 words drawn from the shipped Shakespeare) is written
once; `python -m data.prepare` runs on it in a fresh subprocess (wall time, tokens/s, the peak RSS of that
process from wait4, the output's size); then the ceiling — `encode_ordinary_batch(texts, num_threads=cores)`
on the same file's documents, read in ~16 MB batches, timing only the encoder (up to --ceiling_bytes of text).
On a machine shared with other jobs the wall-clock rates drift between the two measurements, so the CPU-time
rates (tokens per CPU-second of the whole prepare process, of the encoder threads) are printed beside them.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from data.prepare import SHAKESPEARE
from data.tokenizer import get_tokenizer

ROOT = Path(__file__).resolve().parent.parent
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper()
    return int(float(text[:-1]) * UNITS[text[-1]]) if text[-1] in UNITS else int(text)


def synthesize(path: Path, size: int, seed: int = 0) -> int:
    """Writes ~size bytes of JSON lines; returns the number of documents."""
    words = lzma.open(SHAKESPEARE, "rt").read().split()
    rng = random.Random(seed)
    pool = [" ".join(rng.choices(words, k=rng.randint(100, 3000))) for _ in range(2000)]
    lines = [json.dumps({"text": d}) + "\n" for d in pool]
    written = docs = 0
    with open(path, "w") as f:
        while written < size:
            line = lines[rng.randrange(len(lines))]
            f.write(line)
            written += len(line.encode())
            docs += 1
    return docs


def run_prepare(source: Path, out: Path) -> dict:
    cmd = [sys.executable, "-m", "data.prepare", "--source", str(source), "--out_dir", str(out)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if status:
        raise SystemExit(f"{' '.join(cmd)} failed with status {status}")
    meta = json.loads((out / "meta.json").read_text())
    tokens = meta["train_tokens"] + meta["val_tokens"]
    out_bytes = sum(p.stat().st_size for p in out.iterdir())
    cpu = usage.ru_utime + usage.ru_stime
    return {"wall": wall, "cpu": cpu, "tokens": tokens, "rss": usage.ru_maxrss * 1024, "out_bytes": out_bytes}


def ceiling(source: Path, limit: int, threads: int) -> tuple[float, float]:
    """tiktoken's encode_ordinary_batch tokens per second and per CPU-second (encoder time only)."""
    enc = get_tokenizer()
    tokens, wall, cpu, batch, size, seen = 0, 0.0, 0.0, [], 0, 0

    def encode():
        t0, c0 = time.perf_counter(), time.process_time()
        n = sum(map(len, enc.encode_ordinary_batch(batch, num_threads=threads)))
        return n, time.perf_counter() - t0, time.process_time() - c0

    with open(source) as f:
        for line in f:
            batch.append(json.loads(line)["text"])
            size += len(line)
            if size >= 16 << 20 or seen + size >= limit:
                n, w, c = encode()
                tokens, wall, cpu = tokens + n, wall + w, cpu + c
                seen, batch, size = seen + size, [], 0
                if seen >= limit:
                    break
    if batch:
        n, w, c = encode()
        tokens, wall, cpu = tokens + n, wall + w, cpu + c
    return tokens / wall, tokens / cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="50M,500M,2G", help="comma-separated sizes of synthetic text")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--ceiling_bytes", default="512M", help="text the ceiling is measured on, per size")
    args = parser.parse_args()
    threads = len(os.sched_getaffinity(0))
    scratch = Path(tempfile.mkdtemp(prefix="prepare-bench-", dir=args.dir))
    print(f"{threads} cores; data.prepare with its defaults; ceiling: encode_ordinary_batch(num_threads={threads})")
    print(f"{'text':>6} {'docs':>9} {'tokens':>13} {'wall s':>7} {'tok/s':>7} {'ceiling':>7} {'ratio':>5}"
          f" {'tok/cpu-s':>9} {'ceiling':>7} {'ratio':>5} {'peak RSS':>8} {'out':>7}")
    try:
        for spec in args.sizes.split(","):
            size = parse_size(spec)
            source, out = scratch / f"synthetic-{spec}.jsonl", scratch / f"out-{spec}"
            docs = synthesize(source, size)
            r = run_prepare(source, out)
            top, top_cpu = ceiling(source, parse_size(args.ceiling_bytes), threads)
            rate, rate_cpu = r["tokens"] / r["wall"], r["tokens"] / r["cpu"]
            print(f"{spec:>6} {docs:>9,} {r['tokens']:>13,} {r['wall']:>7.1f} {rate / 1e6:>6.2f}M"
                  f" {top / 1e6:>6.2f}M {rate / top:>5.2f} {rate_cpu / 1e6:>8.2f}M {top_cpu / 1e6:>6.2f}M"
                  f" {rate_cpu / top_cpu:>5.2f} {r['rss'] / 2**30:>6.2f}Gi {r['out_bytes'] / 2**20:>5.0f}Mi",
                  flush=True)
            source.unlink()
            shutil.rmtree(out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
