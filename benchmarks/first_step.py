"""Time to the first step: a fresh `python train.py ARGS` process, from its start to its first train call's end, and
the programs it compiled on the way (events.jsonl: the goodput record of the run).

    python -m benchmarks.first_step -- --train.steps=20 --run_dir=/tmp/first_step
    python -m benchmarks.first_step --runs 2 -- --config gpt2_124m --data.dataset=DIR --train.batch_size=4 \\
        --train.grad_accum=1 --train.steps=20 --train.steps_per_call=1 --train.stop_after=2

Each run starts on an empty run directory (removed first) with the compilation cache off, unless ARGS name them:
a cold start, as a new run without a warm cache has. docs/performance.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def first_step(args: list[str]) -> dict:
    """One cold start of train.py with `args`: seconds to the first call's end, the compiles before it and in all."""
    run_dir = next((a.split("=", 1)[1] for a in args if a.startswith("--run_dir=")), None)
    if run_dir is None:
        run_dir = tempfile.mkdtemp(prefix="first_step-")
        args = [*args, f"--run_dir={run_dir}"]
    shutil.rmtree(run_dir, ignore_errors=True)
    if not any(a.startswith("--train.compile_cache") for a in args):
        args = [*args, "--train.compile_cache=off"]
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), "--log.wandb=disabled", "--log.progress=False",
                           *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"train.py failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    records = [json.loads(line) for line in (Path(run_dir) / "events.jsonl").read_text().splitlines()]
    start = next(r["time"] for r in records if r["event"] == "attempt_start")
    first = next(r["end"] for r in records if r["event"] == "train_call")
    compiles = [r for r in records if r["event"] == "interval" and r["kind"] == "compile"]
    before = [c for c in compiles if c["start"] < first]
    programs = lambda cs: sum(sum(c["programs"].values()) for c in cs)  # noqa: E731
    return {"first_step_s": first - start, "programs_before_first_step": programs(before),
            "programs": programs(compiles), "compile_s": sum(c["end"] - c["start"] for c in compiles)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1, help="cold starts to measure (each printed)")
    parser.add_argument("train_args", nargs="*", help="train.py's flags, after --")
    opts = parser.parse_args()
    for _ in range(opts.runs):
        print(json.dumps(first_step(opts.train_args)), flush=True)


if __name__ == "__main__":
    main()
