"""A long run stays flat: the default config trained for a long time, its resident memory and per-step time
compared between the start (after warm-up) and the end.

    nice -n 10 python -m benchmarks.soak                          # 30 minutes or 20,000 steps, whichever first
    python -m benchmarks.soak --minutes 60 --json soak.json -- --train.batch_size=16

It runs the real `train.py` (the default preset, evaluation, checkpoints and wandb offline at their default
cadence; `--train.steps` sets the schedule's length) as a child process, samples the child's resident memory
(VmRSS, plus any Grain workers') every few seconds, and ends the run with SIGTERM at the time limit (a
preemption: a checkpoint, exit 0). Per-step time comes from metrics.jsonl (`batch × seq_len / tokens_per_s`
of each call, so calls cut short at an evaluation or a checkpoint weigh the same per step).

Warm-up (compilation, the first evaluations and saves, the allocator reaching its working set) is the first
`--warmup` steps (at most half of the run). The start window is the next `--window` share of the steps, the end
window the last one; the figures are each window's median, RSS sampled while train calls ran (each sample placed
at the step reached, from events.jsonl; the start-up and the final save and sample are left out). Goals: RSS
growth and step-time drift both within 5 %.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL = 0.05  # the bound on RSS growth and step-time drift


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """Resident memory of `pid` and its children (Grain workers), from /proc: all of it (VmRSS), or its
    anonymous part (RssAnon: the heap, what a leak grows; the rest is mapped files, which the kernel may drop
    and fault back in under a neighbour's memory pressure). 0 once it has exited."""
    total = 0
    for p in [pid, *children(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith(field + ":"):
                    total += int(line.split()[1]) * 1024
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def sample_memory(proc: subprocess.Popen, every: float, samples: list) -> None:
    """Appends (Unix time, RSS bytes, anonymous RSS bytes) until the child exits."""
    while proc.poll() is None:
        samples.append((time.time(), rss_bytes(proc.pid), rss_bytes(proc.pid, "RssAnon")))
        time.sleep(every)


def run_training(run_dir: Path, steps: int, minutes: float, extra: list[str], every: float) -> tuple[list, int]:
    """Trains until `steps` or `minutes`; returns the RSS samples (Unix time, bytes) and train.py's exit
    status."""
    command = [sys.executable, "train.py", f"--run_dir={run_dir}", f"--train.steps={steps}", "--log.wandb=offline",
               "--log.progress=false", *extra]
    samples: list = []
    with open(run_dir.parent / "train.log", "w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        sampler = threading.Thread(target=sample_memory, args=(proc, every, samples), daemon=True)
        sampler.start()
        try:
            proc.wait(timeout=minutes * 60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # a preemption: it saves and exits 0
            proc.wait()
        sampler.join()
    return samples, proc.returncode


def step_times(metrics_path: Path) -> list[tuple[int, float]]:
    """(step, seconds per step) of every training record of metrics.jsonl."""
    out = []
    for line in metrics_path.read_text().splitlines():
        r = json.loads(line)
        if r.get("tokens_per_s"):  # null for the first call (its time holds the first load)
            out.append((r["step"], r["tokens"] / r["step"] / r["tokens_per_s"]))  # tokens / step = B × T
    return out


def steps_reached(events_path: Path) -> list[tuple[float, int]]:
    """(Unix time, step reached) at the end of every train call, from events.jsonl."""
    calls = [json.loads(line) for line in events_path.read_text().splitlines()]
    return [(c["end"], c["first"] + c["steps"]) for c in calls if c.get("event") == "train_call"]


def at_steps(samples: list, reached: list[tuple[float, int]], column: int = 1) -> list[tuple[int, float]]:
    """The RSS samples (`column` of each) taken while training ran, each placed at the step the run had
    reached: the start-up before the first call and the shutdown after the last one (a final save and sample)
    are left out."""
    out, i = [], 0
    for t, *values in samples:
        rss = values[column - 1]
        while i < len(reached) and reached[i][0] <= t:
            i += 1
        if 0 < i < len(reached) and rss:
            out.append((reached[i - 1][1], float(rss)))
    return out


def windows(values: list[tuple[int, float]], warmup: int, window: float) -> tuple[float, float]:
    """Medians of `values` ((step, value), steps ascending) in the start window (the `window` share of the
    steps right after `warmup` steps, or after half of them in a shorter run) and the end window (the last
    `window` share)."""
    last = values[-1][0]
    start_lo = min(warmup, last // 2)
    past = [v for s, v in values if s > start_lo]  # never empty: start_lo < last
    start = [v for s, v in values if start_lo < s <= start_lo + window * last] or past[:1]  # at least a call
    end = [v for s, v in values if s > last - window * last]
    return statistics.median(start), statistics.median(end)


def analyse(samples: list, reached: list, steps: list, warmup: int, window: float) -> dict:
    """The soak's figures: RSS and step time at the start and end windows, and their relative change."""
    rss0, rss1 = windows(at_steps(samples, reached), warmup, window)
    anon = {}
    if len(samples[0]) > 2:  # samples of RssAnon too
        anon0, anon1 = windows(at_steps(samples, reached, 2), warmup, window)
        anon = {"anon_start_mib": anon0 / 2**20, "anon_end_mib": anon1 / 2**20, "anon_growth": anon1 / anon0 - 1}
    dt0, dt1 = windows(steps, warmup, window)
    return {
        **anon,
        "steps": steps[-1][0] if steps else 0, "minutes": (samples[-1][0] - samples[0][0]) / 60 if samples else 0.0,
        "rss_start_mib": rss0 / 2**20, "rss_end_mib": rss1 / 2**20, "rss_growth": rss1 / rss0 - 1,
        "rss_peak_mib": max(s[1] for s in samples) / 2**20,
        "step_ms_start": dt0 * 1e3, "step_ms_end": dt1 * 1e3, "step_time_drift": dt1 / dt0 - 1,
    }


def report(r: dict) -> str:
    verdict = lambda x: "within" if abs(x) <= GOAL else "OVER"  # noqa: E731
    anon = ([f"anonymous  {r['anon_start_mib']:8.1f} MiB -> {r['anon_end_mib']:8.1f} MiB  {r['anon_growth']:+.2%}"
             "  (the heap: what a leak grows)"] if "anon_growth" in r else [])
    return "\n".join([
        f"soak: {r['steps']:,} steps in {r['minutes']:.1f} min (load average {r.get('loadavg', '?')})",
        f"RSS        {r['rss_start_mib']:8.1f} MiB -> {r['rss_end_mib']:8.1f} MiB  {r['rss_growth']:+.2%}"
        f"  ({verdict(r['rss_growth'])} the {GOAL:.0%} goal; peak {r['rss_peak_mib']:.1f} MiB)",
        *anon,
        f"step time  {r['step_ms_start']:8.2f} ms  -> {r['step_ms_end']:8.2f} ms   {r['step_time_drift']:+.2%}"
        f"  ({verdict(r['step_time_drift'])} the {GOAL:.0%} goal)",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20_000, help="train.steps: the schedule and the step limit")
    p.add_argument("--minutes", type=float, default=30.0, help="stop (SIGTERM) after this long")
    p.add_argument("--warmup", type=int, default=500,
                   help="steps left out at the start (the default config's first 5 evaluations and 2 checkpoints)")
    p.add_argument("--window", type=float, default=0.1, help="share of the run each window covers")
    p.add_argument("--sample_every", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--work_dir", default=None, help="where the run directory and train.log go (default: a temp)")
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("train_flags", nargs=argparse.REMAINDER, help="-- then more train.py flags")
    args = p.parse_args(argv)
    extra = args.train_flags[1:] if args.train_flags[:1] == ["--"] else args.train_flags
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="soak-"))
    work.mkdir(parents=True, exist_ok=True)
    samples, code = run_training(work / "run", args.steps, args.minutes, extra, args.sample_every)
    if code != 0:
        print(f"error: train.py exited {code}; see {work / 'train.log'}", file=sys.stderr)
        return 1
    run = work / "run"
    figures = {**analyse(samples, steps_reached(run / "events.jsonl"), step_times(run / "metrics.jsonl"),
                         args.warmup, args.window),
               "loadavg": " ".join(f"{x:.1f}" for x in os.getloadavg()), "cpus": os.cpu_count()}
    print(report(figures))
    if args.json:
        Path(args.json).write_text(json.dumps({**figures, "rss_samples": samples}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
