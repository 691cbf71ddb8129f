"""The documentation's commands run as written (with small step counts), so README.md and docs/ cannot drift from
the code; their links lead somewhere, and the README's guided tour names files that exist.

Blocks marked `<!-- README test: bash -->` / `<!-- README test: python -->` in README.md and in every docs/*.md
page are run here; every other block needs what this machine lacks (a TPU, a hub, a cluster, /data) or takes
minutes. The shell blocks of all pages run in one scratch directory, in a fixed order of pages (PAGE_ORDER, then
any other page), so that a page's commands find the run directories an earlier page made; a command that
appears on several pages runs once. Substitutions, the same for every command: the interpreter for `python` /
`.venv/bin/python`, the repository's scripts and assets by absolute path, and for train.py a 4-step schedule
(checkpoints at 2 and 4) — so `--step 400` becomes `--step 4` and `--batches 20` `--batches 2` in eval.py's
examples.
"""

import re
import subprocess
import sys


from support.cli import ROOT, cli_env
from support.docs import commands, marked_blocks

SMALL_RUN = ["--train.steps=4", "--checkpoint.every=2", "--train.eval_every=2", "--train.steps_per_call=2",
             "--train.eval_batches=1", "--train.sample_tokens=4", "--log.wandb=disabled", "--log.progress=false"]


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


def test_every_marked_shell_command_runs_as_written(tmp_path, shakespeare):
    env = {k: v for k, v in cli_env(1).items() if k != "XLA_FLAGS"}  # a laptop: one CPU device
    env["PYTHONPATH"] = str(ROOT)
    ran = []
    for command in commands():
        words = runnable(command, shakespeare)
        if words in ran:  # the same command on two pages
            continue
        ran.append(words)
        r = subprocess.run(words, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{command}\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}"
    assert (tmp_path / "runs" / "shakespeare_cpu" / "checkpoints" / "4").is_dir()
    assert (tmp_path / "runs" / "data" / "shakespeare" / "meta.json").is_file()
    assert (tmp_path / "runs" / "shakespeare_cpu" / "hf" / "model.safetensors").is_file()


def test_the_library_snippet_runs_as_written(tmp_path):
    (snippet,) = marked_blocks("python", ROOT / "README.md")
    env = {**cli_env(8), "PYTHONPATH": str(ROOT)}  # the README's XLA_FLAGS: 8 fake CPU devices
    r = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("(8, 2, 50257)")
    assert (tmp_path / "runs" / "hf-gpt2" / "model.safetensors").is_file()
