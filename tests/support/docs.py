"""The documentation's runnable blocks: `<!-- README test: bash -->` / `python` blocks of README.md and docs/, in the
order their commands run."""

import re
from pathlib import Path

from support.cli import ROOT

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
