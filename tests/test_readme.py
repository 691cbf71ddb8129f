"""The README's commands run as written (with small step counts), so the README cannot drift from the code.

Blocks marked `<!-- README test: bash -->` / `<!-- README test: python -->` are run here, in a scratch
directory; every other block needs what this machine lacks (a TPU, a hub, a cluster, /data). Substitutions,
the same for every command: the interpreter for `python` / `.venv/bin/python`, the repository's scripts and
assets by absolute path, and for train.py a 4-step schedule (checkpoints at 2 and 4) — so `--step 400`
becomes `--step 4` and `--batches 20` `--batches 2` in eval.py's examples.
"""

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, cli_env

pytestmark = pytest.mark.slow

SMALL_RUN = ["--train.steps=4", "--checkpoint.every=2", "--train.eval_every=2", "--train.steps_per_call=2",
             "--train.eval_batches=1", "--train.sample_tokens=4", "--log.wandb=disabled", "--log.progress=false"]


def marked_blocks(kind: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(rf"<!-- README test: {kind} -->\n```{kind}\n(.*?)```", text, flags=re.S)


def commands() -> list[str]:
    lines = [line.split("  #")[0].strip() for block in marked_blocks("bash") for line in block.splitlines()]
    return [line for line in lines if line]


def runnable(command: str, shakespeare) -> list[str]:
    command = command.replace(".venv/bin/python", "python").replace("data/assets/", f"{ROOT}/data/assets/")
    words = re.findall(r'"[^"]*"|\S+', command)
    words = [w.strip('"') for w in words]
    words = [sys.executable if w == "python" else str(ROOT / w) if w in ("train.py", "eval.py") else w
             for w in words]
    if str(ROOT / "train.py") in words and "--help" not in words:
        words += [*SMALL_RUN, f"--data.cache_dir={shakespeare}"]
    if str(ROOT / "eval.py") in words:
        words = ["4" if w == "400" else "2" if w == "20" else w for w in words]
        words += [] if "--batches" in words else ["--batches", "2"]
    return words


def test_the_readme_has_runnable_blocks():
    assert len(commands()) >= 8 and len(marked_blocks("python")) == 1


def test_every_marked_shell_command_runs_as_written(tmp_path, shakespeare):
    env = {k: v for k, v in cli_env(1).items() if k != "XLA_FLAGS"}  # a laptop: one CPU device
    env["PYTHONPATH"] = str(ROOT)
    for command in commands():
        r = subprocess.run(runnable(command, shakespeare), cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, f"{command}\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}"
    assert (tmp_path / "runs" / "shakespeare_cpu" / "checkpoints" / "4").is_dir()
    assert (tmp_path / "runs" / "data" / "shakespeare" / "meta.json").is_file()


def test_the_library_snippet_runs_as_written(tmp_path):
    (snippet,) = marked_blocks("python")
    env = {**cli_env(8), "PYTHONPATH": str(ROOT)}  # the README's XLA_FLAGS: 8 fake CPU devices
    r = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("(8, 2, 50257)")
    assert (tmp_path / "runs" / "hf-gpt2" / "model.safetensors").is_file()
