"""How long the devices wait for the host in train.py's loop: its share of a train call's wall time, with the
loop that waits after every call (train.async_calls=False) and the one that dispatches call n+1 before
reading call n (the default).

    python -m benchmarks.host_loop                      # the smoke shape and a loader-heavy one
    python -m benchmarks.host_loop --shapes smoke --calls 20 --json out.json

Each mode runs the real train.py loop in this process on the embedded corpus (no evaluation, one checkpoint
at the end). Per call: `device` is the time from dispatch to metrics-ready when the host waits for every call
(the host's work then lies outside it), `cycle` the time between consecutive calls' metrics becoming ready
(the loop's real pace). The host's share is 1 - device / cycle: the part of each call the devices sit idle.
The first calls (compilation) and the last (the final save) are left out; figures are medians.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import tempfile

import train
from trainer.run.loop import TrainingLoop

SHAPES = {
    # the CPU smoke shape of benchmarks/train_step.py
    "smoke": ["--model.n_layer=4", "--model.n_head=4", "--model.n_embd=128", "--model.block_size=64",
              "--train.batch_size=12", "--train.seq_len=64", "--train.steps_per_call=4"],
    # 8x the smoke shape's rows per call through the loader and the host-to-device copy, the smallest model (the
    # 50k-token output layer still costs ~10 MFLOP a token: on a CPU the devices stay the slower side)
    "loader": ["--model.n_layer=1", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=64",
               "--model.pad_vocab_to=128", "--train.batch_size=96", "--train.seq_len=64",
               "--train.steps_per_call=4"],
}


def measure(shape: str, async_calls: bool, calls: int) -> dict:
    """Per-call (dispatched, ready) times of one run of the real loop."""
    events, finish = [], TrainingLoop.finish

    def timed_finish(self, c, **kw):
        ok = finish(self, c, **kw)
        events.append((c.dispatched, self.last_ready))  # last_ready: when the call's metrics arrived
        return ok

    k = int(next(a for a in SHAPES[shape] if "steps_per_call" in a).split("=")[1])
    with tempfile.TemporaryDirectory() as run_dir, contextlib.redirect_stdout(io.StringIO()):
        TrainingLoop.finish = timed_finish
        try:
            code = train.main(["--run_dir", run_dir, *SHAPES[shape], f"--train.steps={calls * k}",
                               "--train.eval_every=0", f"--checkpoint.every={calls * k}", "--train.sample_tokens=0",
                               "--log.wandb=disabled", "--log.progress=False", "--schedule.warmup_steps=2",
                               f"--train.async_calls={async_calls}"])
        finally:
            TrainingLoop.finish = finish
    assert code == 0, f"train.py failed ({code})"
    steady = events[2:-1]  # after compilation and the first calls, before the final save
    cycles = [b[1] - a[1] for a, b in zip(steady, steady[1:])]
    return {"device_s": statistics.median(r - d for d, r in steady), "cycle_s": statistics.median(cycles)}


def run(shapes: list[str], calls: int) -> dict:
    results = {}
    for shape in shapes:
        waiting, overlapped = measure(shape, False, calls), measure(shape, True, calls)
        device = waiting["device_s"]  # the devices' time per call, measured with nothing overlapping it
        results[shape] = {
            "device_s": device,
            "sync_cycle_s": waiting["cycle_s"], "sync_host_share": 1 - device / waiting["cycle_s"],
            "async_cycle_s": overlapped["cycle_s"],
            "async_host_share": max(0.0, 1 - device / overlapped["cycle_s"]),
        }
    return results


def print_table(results: dict) -> None:
    print(f"{'shape':<8} {'device/call':>12} {'waiting loop':>22} {'async loop':>22}")
    for shape, r in results.items():
        print(f"{shape:<8} {r['device_s'] * 1e3:>10.1f}ms {r['sync_cycle_s'] * 1e3:>9.1f}ms"
              f" host {r['sync_host_share']:>5.1%}  {r['async_cycle_s'] * 1e3:>9.1f}ms"
              f" host {r['async_host_share']:>5.1%}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    p.add_argument("--calls", type=int, default=12, help="train calls per run (>= 6)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.calls < 6:
        p.error("--calls must be >= 6 (two warm-up calls, the last one saves)")
    results = run(args.shapes, args.calls)
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
