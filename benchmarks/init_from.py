"""What `train.py --init_from` costs each process of a job: the seconds and the host memory of reading a Hugging
Face checkpoint into the run's parameter shardings.

    python -m benchmarks.init_from --hf /tmp/gpt2-medium --make gpt2_medium   # write a random checkpoint first
    python -m benchmarks.init_from --hf /tmp/gpt2-medium --processes 2        # 2 processes × 4 CPU devices

Each process loads the weights as train.py does (`trainer.run.init_from.load_params`, with the default preset
and any further config flags given, e.g. `--mesh.tensor=2 --mesh.rules=fsdp_tp`; default fsdp over every
device) and reports its seconds, how much its peak resident memory grew
(anonymous: its own arrays; file-backed: the memory-mapped file's pages it touched, which belong to the page
cache) and a digest of every shard it holds; `--out DIR` keeps
one JSON record per process, which tests compare across process counts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from errors import one_line_errors

SHAPES = {  # Hugging Face's GPT-2 sizes
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2_medium": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2_large": dict(n_layer=36, n_head=20, n_embd=1280),
}


def make_checkpoint(directory: Path, shape: str) -> None:
    """A checkpoint of GPT-2's vocabulary and context with random weights, written as train.py exports."""
    from flax import nnx

    from gpt2 import GPT2, GPT2Config, to_hf

    to_hf(GPT2(GPT2Config(vocab_size=50257, block_size=1024, **SHAPES[shape]), rngs=nnx.Rngs(0)), directory)


def resident_bytes() -> dict[str, int]:
    """This process's resident memory now: anonymous (its own arrays) and file-backed (mapped files' pages,
    which are the page cache's: shared, and dropped under memory pressure)."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {key: int(fields[key].split()[0]) * 1024 for key in ("RssAnon", "RssFile")}


class PeakMemory(threading.Thread):
    """Samples `resident_bytes` every few milliseconds while a load runs: the peaks of each kind."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.stopped = resident_bytes(), threading.Event()

    def run(self):
        while not self.stopped.wait(0.005):
            self.peak = {k: max(v, self.peak[k]) for k, v in resident_bytes().items()}

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stopped.set()
        self.join()


def load(hf: str, config_flags: list[str]) -> dict:
    """One process's load, as train.py makes it: (seconds, peak memory growth, shard digests)."""
    import jax
    from flax import nnx

    import configs
    from configs.base import Config, DistributedConfig
    from configs.cli import parse
    from gpt2.hf import SafetensorsFiles
    from gpt2.sharding import ShardingRules
    from trainer.processes import initialize_distributed
    from trainer.program.layout import ModelLayout
    from trainer.program.mesh import build_mesh
    from trainer.run import init_from

    initialize_distributed(DistributedConfig())
    argv = ["--init_from", hf, "--train.batch_size", str(jax.device_count()), *config_flags]
    cfg = init_from.resolve(parse(Config, argv, default=configs.load(configs.DEFAULT), prog="init_from"), argv)
    layout = ModelLayout.build(cfg.model, build_mesh(cfg), ShardingRules.preset(cfg.mesh.rules))
    before, started = resident_bytes(), time.perf_counter()
    with PeakMemory() as memory:
        params = jax.block_until_ready(init_from.load_params(cfg, layout))
    seconds = time.perf_counter() - started
    shards = {}
    for path, leaf in nnx.to_flat_state(params):
        for shard in leaf.get_value().addressable_shards:
            key = "/".join(map(str, path)) + str([(s.start, s.stop) for s in shard.index])
            shards[key] = hashlib.sha256(jax.device_get(shard.data).tobytes()).hexdigest()[:16]
    return {"process": jax.process_index(), "processes": jax.process_count(), "seconds": seconds,
            "anonymous_growth_bytes": memory.peak["RssAnon"] - before["RssAnon"],
            "file_pages_bytes": memory.peak["RssFile"] - before["RssFile"], "read_bytes": SafetensorsFiles.bytes_read,
            "held_bytes": sum(
                s.data.nbytes for leaf in jax.tree.leaves(params) for s in leaf.addressable_shards
                if s.replica_id == 0), "shards": shards}


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.init_from", description=__doc__.splitlines()[0])
    parser.add_argument("--hf", required=True, help="a Hugging Face GPT-2 directory (config.json + safetensors)")
    parser.add_argument("--make", choices=sorted(SHAPES), help="first write a random checkpoint of this size there")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--devices", type=int, default=8, help="CPU devices in all (split over the processes)")
    parser.add_argument("--out", help="a directory for each process's JSON record")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one process of the job
    args, config_flags = parser.parse_known_args(argv)
    config_flags = config_flags or [f"--mesh.fsdp={args.devices}", "--mesh.data=1", "--mesh.rules=fsdp"]
    if args.worker:
        record = load(args.hf, config_flags)
        if args.out:
            Path(args.out, f"process_{record['process']}.json").write_text(json.dumps(record))
        gib = {k: record[k] / 2**30 for k in ("anonymous_growth_bytes", "file_pages_bytes", "read_bytes",
                                              "held_bytes")}
        print(f"process {record['process']} of {record['processes']}: {record['seconds']:.1f} s, read"
              f" {gib['read_bytes']:.2f} GiB, peak anonymous memory +{gib['anonymous_growth_bytes']:.2f} GiB, mapped"
              f" file pages +{gib['file_pages_bytes']:.2f} GiB, holding {gib['held_bytes']:.2f} GiB of parameters")
        return 0
    if args.make:
        make_checkpoint(Path(args.hf), args.make)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "benchmarks.init_from", "--worker", "--hf", args.hf,
               *(["--out", args.out] if args.out else []), *config_flags]
    return subprocess.run([sys.executable, "-m", "tools.launch", "--num_processes", str(args.processes),
                           "--devices_per_process", str(args.devices // args.processes), "--", *command]).returncode


if __name__ == "__main__":
    sys.exit(main())
