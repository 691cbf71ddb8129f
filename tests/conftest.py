"""Test set-up: 8 fake CPU devices (set before JAX is imported), one JAX compilation cache for the session
(shared by every subprocess, so a program compiled by one CLI run is loaded by the next), a shared tokenized
corpus, and CLI helpers: `run_cli` (a subprocess) and `run_main` (in-process, for checks before any JAX work).
"""

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# JAX's persistent compilation cache: each pytest session (and its xdist workers, which inherit the variable
# from the controller) compiles a program once. The first run of every program still compiles from scratch.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="gpt2-nnx-jax-cache-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# A CLI run small enough for the test budget: 2 layers, width 32, 32-token windows. decay_steps is fixed so
# that runs of any --train.steps share one learning-rate schedule.
SMALL = [
    "--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=64", "--model.pad_vocab_to=128",
    "--train.seq_len=32", "--train.batch_size=8", "--train.steps_per_call=2",
    "--train.eval_batches=2", "--train.sample_tokens=0", "--log.wandb=disabled", "--log.progress=False",
    "--optim.warmup_steps=2", "--optim.decay_steps=1000",
]


@pytest.fixture(scope="session")
def shakespeare(tmp_path_factory) -> Path:
    """The embedded corpus, tokenized once for the whole session."""
    from data.prepare import prepare_shakespeare

    return prepare_shakespeare(tmp_path_factory.mktemp("shakespeare"), quiet=True)


def cli_env(devices: int = 8, env: dict | None = None) -> dict:
    return {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
            **(env or {})}


def run_cli(script: str, *args: str, devices: int = 8, timeout: int = 600, env: dict | None = None):
    """Runs `python <script> args...` in a subprocess with `devices` fake CPU devices."""
    return subprocess.run([sys.executable, str(ROOT / script), *args], cwd=ROOT, env=cli_env(devices, env),
                          capture_output=True, text=True, timeout=timeout)


def run_main(main, *args: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of an entry point's `main(argv)` called in this process: for the checks
    that end a run before any JAX work, in milliseconds instead of a subprocess's seconds."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args)) or 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def step_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


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
