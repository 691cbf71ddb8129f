"""How long a TPU compile of the train call takes on this machine: an estimate said before the compile starts, and
a record of what each compile here took, from which the next estimate learns this machine's speed.

A compile's time grows with the program's size (its lowered text: layers unrolled, micro-batches, collectives)
and with the size of its arrays (a micro-batch's tokens per chip). Fitted, as a power law of both, to compiles of
the train call on the 2-core development machine (`train.steps_per_call=1`; seconds of `lowered.compile()`):

| program | topology | lowered text | tokens per chip | compile |
|---|---|---|---|---|
| 1 layer, width 64, 128-token windows, vocabulary 512 | v5e:2x2 | 0.28 M characters | 256 | 8.3 s |
| gpt2_124m's shapes, 1 layer of width 64 | v5e:2x4 | 0.32 M | 8,192 | 54.7 s |
| gpt2_124m, 12 layers scanned | v5e:2x4 | 0.40 M | 8,192 | 75.0 s |
| gpt2_124m, 2 of its layers | v5e:2x4 | 0.50 M | 8,192 | 69.6 s |
| gpt2_124m | v5e:2x4 | 2.20 M | 8,192 | 149 s |
| gpt2_124m (10 steps per call) | v6e:1x1 | 2.20 M | 65,536 | ~290 s |
| gpt2_xl_pod | v5e:16x16 | 10.96 M | 4,096 | ~13 min |

The fit is within 0.67-1.42x of each. The machine was shared and busy: the same gpt2_124m compile took 106 s on a
quieter day; hence each machine's own record scales it.
A compile the TPU compiler refuses (the program does not fit) ends early, in seconds, and is not recorded.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path

from planning import compile_store

# seconds = SCALE × characters^SIZE_POWER × tokens^TOKENS_POWER: the least-squares fit of log seconds to the table
SCALE, SIZE_POWER, TOKENS_POWER = math.exp(-9.525), 0.791, 0.365
RECENT = 20  # compiles of this machine the estimate is scaled by (the latest)


def reference_s(size: int, tokens_per_chip: float) -> float:
    """The fit's compile seconds on the development machine."""
    return SCALE * size ** SIZE_POWER * max(tokens_per_chip, 1.0) ** TOKENS_POWER


def _records() -> Path:
    return Path(os.path.expanduser(compile_store.STORE)) / "compile_times.jsonl"


def _past() -> list[tuple[float, float, float]]:
    """This machine's latest compiles (size, tokens per chip, seconds)."""
    try:
        lines = _records().read_text().splitlines()[-RECENT:]
    except OSError:
        return []
    past = []
    for line in lines:
        try:
            r = json.loads(line)
            past.append((float(r["size"]), float(r["tokens_per_chip"]), float(r["seconds"])))
        except (ValueError, TypeError, KeyError):  # a line cut short by a kill, or written by something else
            continue
    return [r for r in past if r[0] > 0]


def estimate(size: int, tokens_per_chip: float) -> tuple[float, str]:
    """(seconds the compile may take here, what that is based on)."""
    past = _past()
    if not past:
        return reference_s(size, tokens_per_chip), "fitted to compiles on a 2-core machine"
    speed = statistics.median(seconds / reference_s(size, tokens) for size, tokens, seconds in past)
    return (speed * reference_s(size, tokens_per_chip),
            f"a fit to compiles on a 2-core machine, scaled by this machine's last {len(past)}")


def record(size: int, tokens_per_chip: float, seconds: float) -> None:
    """Keeps what a compile here took, for the next estimates."""
    line = json.dumps({"size": size, "tokens_per_chip": tokens_per_chip, "seconds": round(seconds, 2)})
    try:
        _records().parent.mkdir(parents=True, exist_ok=True)
        with open(_records(), "a") as f:  # one short line per write: concurrent plan.py runs do not interleave
            f.write(line + "\n")
    except OSError:
        pass  # an unwritable store only costs the estimate its calibration


def minutes(seconds: float) -> str:
    """'under a minute', 'about 1.5 min', 'about 13 min'."""
    if seconds < 45:
        return "under a minute"
    m = seconds / 60
    return f"about {m:.1f} min" if m < 10 else f"about {m:.0f} min"
