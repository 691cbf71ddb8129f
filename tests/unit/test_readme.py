"""The documentation holds together: it has runnable blocks, its links lead to files and headings that exist, the
README's guided tour and the docs pages the code cites exist. Running its commands: tests/e2e/test_readme.py."""

import re
from pathlib import Path


from support.cli import ROOT
from support.docs import PAGE_ORDER, commands, marked_blocks, pages

SMALL_RUN = ["--train.steps=4", "--checkpoint.every=2", "--train.eval_every=2", "--train.steps_per_call=2",
             "--train.eval_batches=1", "--train.sample_tokens=4", "--log.wandb=disabled", "--log.progress=false"]


def test_the_docs_have_runnable_blocks():
    assert (ROOT / "docs").is_dir() and all((ROOT / p).is_file() for p in PAGE_ORDER)
    assert len(commands()) >= 16
    assert len(marked_blocks("python", ROOT / "README.md")) == 1
    assert not [p for p in pages()[1:] if marked_blocks("python", p)]  # the library snippet lives in the README


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
