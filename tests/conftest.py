"""Test set-up: 8 fake CPU devices (set before JAX is imported), a shared tokenized corpus, CLI helpers."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# A CLI run small enough for the test budget: 2 layers, width 32, 32-token windows.
SMALL = [
    "--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=64", "--model.pad_vocab_to=128",
    "--train.seq_len=32", "--train.batch_size=8", "--train.steps_per_call=2",
    "--train.eval_batches=2", "--train.sample_tokens=0", "--log.wandb=disabled", "--log.progress=False",
    "--optim.warmup_steps=2",
]


@pytest.fixture(scope="session")
def shakespeare(tmp_path_factory) -> Path:
    """The embedded corpus, tokenized once for the whole session."""
    from data.prepare import prepare_shakespeare

    return prepare_shakespeare(tmp_path_factory.mktemp("shakespeare"), quiet=True)


def run_cli(script: str, *args: str, devices: int = 8, timeout: int = 600, env: dict | None = None):
    """Runs `python <script> args...` in a subprocess with `devices` fake CPU devices."""
    full_env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
                "JAX_PLATFORMS": "cpu", **(env or {})}
    return subprocess.run([sys.executable, str(ROOT / script), *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
