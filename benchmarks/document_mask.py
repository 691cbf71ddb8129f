"""What `model.document_mask` (and `document_positions`) cost per train call, on this machine.

    python -m benchmarks.document_mask                        # shakespeare_cpu's shape: 8 × 128 tokens, K = 10
    python -m benchmarks.document_mask --seq_len 256 --batch_size 4 --repeats 9

The real K-step train call (TrainProgram) of each variant, compiled once, then timed in turns (off, mask,
mask + positions, off, ...) in this one process, so a machine shared with other jobs slows every variant alike;
each figure is the median of --repeats calls. The batches are windows of a prepared corpus (--data; what the
rows hold does not change the work, only B and T do).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import jax
import numpy as np

import configs
from data.prepare import prepare_shakespeare
from trainer.program.mesh import make_mesh
from trainer.program.train_program import TrainProgram

VARIANTS = {
    "off": dict(document_mask=False),
    "mask": dict(document_mask=True),
    "mask+positions": dict(document_mask=True, document_positions=True),
}


def train_call(cfg, batch: np.ndarray):
    """A function running one K-step call of `cfg` on `batch` [K, B, T + 1], already compiled and warm."""
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    program = TrainProgram.build(cfg, mesh)
    with jax.set_mesh(mesh):
        call, state = program.train_call(), [program.init_state()]
        device_batch = jax.device_put(batch, program.batch_sharding)
        active = np.ones(batch.shape[0], bool)

    def run():
        with jax.set_mesh(mesh):
            state[0], metrics = call(state[0], device_batch, active)
            jax.block_until_ready(metrics)

    run()
    return run


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="shakespeare_cpu")
    p.add_argument("--batch_size", type=int, default=None, help="default: the config's")
    p.add_argument("--seq_len", type=int, default=None, help="default: the config's")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--data", default=None, help="a prepared corpus directory (default: the embedded Shakespeare)")
    args = p.parse_args(argv)

    base = configs.load(args.config)
    train = dataclasses.replace(base.train, batch_size=args.batch_size or base.train.batch_size,
                                seq_len=args.seq_len or base.train.seq_len)
    K, B, T = train.steps_per_call, train.batch_size, train.seq_len
    corpus = Path(args.data) if args.data else prepare_shakespeare(Path(base.data.cache_dir).expanduser(), quiet=True)
    tokens = np.fromfile(corpus / "train.bin", np.uint16).astype(np.int32)
    starts = np.random.RandomState(0).randint(0, len(tokens) - T - 1, K * B)
    batch = np.stack([tokens[s:s + T + 1] for s in starts]).reshape(K, B, T + 1)

    calls = {name: train_call(dataclasses.replace(base, train=train, model=dataclasses.replace(base.model, **kw)),
                              batch) for name, kw in VARIANTS.items()}
    wall, cpu = ({name: [] for name in calls} for _ in range(2))
    for _ in range(args.repeats):
        for name, run in calls.items():
            started, started_cpu = time.perf_counter(), time.process_time()
            run()
            wall[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - started_cpu)
    off, off_cpu = statistics.median(wall["off"]), statistics.median(cpu["off"])
    print(f"{args.config}: {K} steps of {B} × {T} tokens per call, median of {args.repeats} calls")
    for name, ts in wall.items():
        median, median_cpu = statistics.median(ts), statistics.median(cpu[name])
        # CPU seconds drift less than wall seconds when other jobs share the cores
        print(f"  {name:15s} {K * B * T / median:8,.0f} tokens/s  {median / off:.3f}× off's wall time"
              f" (min {min(ts):.3f} s, max {max(ts):.3f} s), {median_cpu / off_cpu:.3f}× its CPU time")


if __name__ == "__main__":
    main()
