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
from pathlib import Path

import pytest

from conftest import ROOT, cli_env

SMALL_RUN = ["--train.steps=4", "--checkpoint.every=2", "--train.eval_every=2", "--train.steps_per_call=2",
             "--train.eval_batches=1", "--train.sample_tokens=4", "--log.wandb=disabled", "--log.progress=false"]

# The order the pages' commands run in: the corpus, the training runs, then what reads them.
PAGE_ORDER = ["README.md", "docs/data.md", "docs/training.md", "docs/evaluation.md", "docs/finetune_export.md",
              "docs/goodput.md", "docs/pods.md"]


def pages() -> list[Path]:
    """README.md and every docs/ page, in the order their commands run."""
    ordered = [ROOT / p for p in PAGE_ORDER]
    return ordered + sorted(p for p in (ROOT / "docs").glob("*.md") if p not in ordered)


def marked_blocks(kind: str, page: Path) -> list[str]:
    return re.findall(rf"<!-- README test: {kind} -->\n```{kind}\n(.*?)```", page.read_text(), flags=re.S)


def commands() -> list[str]:
    lines = [line.split("  #")[0].strip() for page in pages() for block in marked_blocks("bash", page)
             for line in block.splitlines()]
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


def test_the_docs_have_runnable_blocks():
    assert (ROOT / "docs").is_dir() and all((ROOT / p).is_file() for p in PAGE_ORDER)
    assert len(commands()) >= 16
    assert len(marked_blocks("python", ROOT / "README.md")) == 1
    assert not [p for p in pages()[1:] if marked_blocks("python", p)]  # the library snippet lives in the README


@pytest.mark.slow
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


@pytest.mark.slow
def test_the_library_snippet_runs_as_written(tmp_path):
    (snippet,) = marked_blocks("python", ROOT / "README.md")
    env = {**cli_env(8), "PYTHONPATH": str(ROOT)}  # the README's XLA_FLAGS: 8 fake CPU devices
    r = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("(8, 2, 50257)")
    assert (tmp_path / "runs" / "hf-gpt2" / "model.safetensors").is_file()


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a `# comment` in a code block is no heading
    return {anchor(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_the_anchor_rule_matches_github():
    assert anchor("Run directories on cloud storage (`gs://`)") == "run-directories-on-cloud-storage-gs"
    assert anchor("Chosen, and why") == "chosen-and-why"


def test_every_relative_link_leads_to_a_file_and_heading():
    broken = []
    for page in pages():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in headings(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_guided_tour_names_files_that_exist():
    readme = (ROOT / "README.md").read_text()
    tour = readme.split("## Dive into the code", 1)[1].split("\n## ", 1)[0]
    paths = [p for p in re.findall(r"`([\w./]+)`", tour) if p.endswith((".py", "/"))]
    assert len(paths) >= 20
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, missing


def test_every_docs_page_the_code_cites_exists():
    packages = ("configs", "data", "gpt2", "trainer", "tools", "benchmarks")
    sources = [p for d in packages for p in (ROOT / d).rglob("*.py")] + list(ROOT.glob("*.py"))
    cited = {m for p in sources for m in re.findall(r"docs/\w+\.md", p.read_text())}
    assert cited and not [c for c in sorted(cited) if not (ROOT / c).is_file()]
