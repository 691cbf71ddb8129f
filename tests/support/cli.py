"""Running the programs from tests: the small CLI run every end-to-end test starts from (`SMALL`), `run_cli` (a
subprocess with fake CPU devices) and `run_main` (in-process, for checks before any JAX work), and readers of what a
run leaves (metrics, checkpoints)."""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the repository

# A CLI run small enough for the test budget: 2 layers, width 32, 32-token windows. decay_steps is fixed so
# that runs of any --train.steps share one learning-rate schedule.
SMALL = [
    "--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=64", "--model.pad_vocab_to=128",
    "--train.seq_len=32", "--train.batch_size=8", "--train.steps_per_call=2",
    "--train.eval_batches=2", "--train.sample_tokens=0", "--log.wandb=disabled", "--log.progress=False",
    "--schedule.warmup_steps=2", "--schedule.decay_steps=1000",
]


def cli_env(devices: int = 8, env: dict | None = None) -> dict:
    return {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
            **(env or {})}


def private_compile_cache(tmp_path: Path) -> dict:
    """The environment of a process whose writes will be cut short (a file-size limit, as a full disk): its own
    copy of the session's compilation cache, as hard links (no bytes copied). It loads what other runs compiled, and
    an entry it writes is its own: one truncated by the limit cannot reach the next process."""
    copy = tmp_path / "compile-cache"
    shutil.copytree(os.environ["JAX_COMPILATION_CACHE_DIR"], copy, copy_function=os.link,
                    ignore=shutil.ignore_patterns(".lockfile"))  # JAX's lock: a file of the copy's own
    return {"JAX_COMPILATION_CACHE_DIR": str(copy)}


def run_cli(script: str, *args: str, devices: int = 8, timeout: int = 600, env: dict | None = None):
    """Runs `python <script> args...` in a subprocess with `devices` fake CPU devices."""
    return subprocess.run([sys.executable, str(ROOT / script), *args], cwd=ROOT, env=cli_env(devices, env),
                          capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def exit_raises():
    """os._exit in the block raises SystemExit instead: a run in this process that fails by abandoning its threads
    (a failed checkpoint save) ends with its status and its line, not by ending the test worker unexplained."""
    real = os._exit

    def exit_(code):
        raise SystemExit(code)

    os._exit = exit_
    try:
        yield
    finally:
        os._exit = real


def run_main(main, *args: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of an entry point's `main(argv)` called in this process: for the checks
    that end a run before any JAX work, in milliseconds instead of a subprocess's seconds."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), exit_raises():
        try:
            code = main(list(args)) or 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def error_line(main, *args) -> str:
    """The one line a program called in-process ends with (exit status 2, no traceback)."""
    code, _, stderr = run_main(main, *args)
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr[-2000:]
    return last_line(stderr)


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# What a run measures rather than computes: never the same twice (the CPU peak that MFU divides by is the best
# measured on the machine so far, so a later run may read a higher one)
TIMING = ("tokens_per_s", "mfu", "peak_flops")


def without_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def step_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def rewound(run: Path, tmp_path: Path, step: int | None) -> Path:
    """A copy of a finished run, as it was when its checkpoint `step` was the latest (None: before any)."""
    run_dir = tmp_path / "run"
    shutil.copytree(run, run_dir)
    for s in checkpoint_steps(run_dir):
        if step is None or s > step:
            shutil.rmtree(run_dir / "checkpoints" / str(s))
    kept = [r for r in read_jsonl(run_dir / "metrics.jsonl") if step is not None and r["step"] <= step]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    (run_dir / "events.jsonl").unlink()  # the copy's time is its own: its record starts with its first attempt
    return run_dir


@contextlib.contextmanager
def read_only(path):
    """A read-only bind mount over `path` (root ignores file modes, so a chmod would prove nothing)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only directory needs root")
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def eval_error(*args) -> str:
    import eval as eval_app

    return error_line(eval_app.main, *args)


def export_error(*args) -> str:
    from tools import export_hf

    return error_line(export_hf.main, *args)


def fsdp_tp_run_args(run_dir, shakespeare, *extra):
    """2 steps of the small model on a 2×2×2 data × fsdp × tensor mesh (parameters split over 4 devices)."""
    return ["--run_dir", str(run_dir), f"--data.cache_dir={shakespeare}", *SMALL, "--train.steps=2",
            "--checkpoint.every=2", "--train.eval_every=0", "--mesh.data=2", "--mesh.fsdp=2", "--mesh.tensor=2",
            "--mesh.rules=fsdp_tp", *extra]


def wandb_records(path):
    """The protobuf records of a .wandb file (wandb's LevelDB-style log: 32 KiB blocks, 7-byte headers).

    A run made in this process is read after wandb.teardown(): run.finish() returns once the service has the
    run's records, and the service writes the file out only as it closes the run, soon after; on busy cores the
    file still held its 7-byte header alone (a CI run; 1 in 25 beside three busy loops). The teardown waits
    for the service to exit; the next wandb.init starts a new one."""
    import struct

    import wandb
    from wandb.proto import wandb_internal_pb2

    wandb.teardown()
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records
