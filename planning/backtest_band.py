"""How far a prediction can be trusted: the measured / predicted ratios of the published runs in the back-test
(planning/backtest.py; sources and analogs: docs/aot_planning.md, "Back-test") whose regime is the prediction's.

A run's regime is its analog's per-chip compute per step (the MXU and transcendental time of one chip's work,
which sets how much fixed costs and collectives weigh against it) and the share of its predicted step that
collectives leave exposed. A prediction is compared with the runs whose compute per chip per step lies within a
factor COMPARABLE_WORK of its own; the range printed is their smallest to largest measured / predicted, widened
to include the prediction itself. A prediction with no such run, or with a larger share of exposed collectives
than any of them by more than COMPARABLE_COLLECTIVES, gets "no comparable measured run" instead of a range.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class MeasuredRun:
    name: str
    compute_s: float  # the analog's predicted compute per chip per step
    exposed_share: float  # exposed collectives / the analog's predicted step
    ratio: float  # measured step / predicted step (the analog's, at the source's measured rate)


# `python -m planning.backtest` (docs/aot_planning.md, "Back-test"): per run, its analog's predicted compute per chip
# per step, the share of its predicted step in exposed collectives, and measured / predicted
RUNS = (
    MeasuredRun("marin_150m_v4", 0.0196, 0.307, 2.590),
    MeasuredRun("marin_130m", 0.0832, 0.013, 1.187),
    MeasuredRun("marin_300m", 0.2068, 0.010, 1.044),
    MeasuredRun("marin_520m", 1.0699, 0.004, 0.948),
    MeasuredRun("llama3_8b_v6e8", 2.2574, 0.296, 0.709),
    MeasuredRun("marin_1_2b", 2.2946, 0.005, 0.771),
    MeasuredRun("maxtext_16b_v5e", 7.6659, 0.104, 1.153),
    MeasuredRun("maxtext_22b_v4", 9.9594, 0.213, 1.048),
)
COMPARABLE_WORK = 4.0  # runs within this factor of a program's compute per chip per step share its regime
COMPARABLE_COLLECTIVES = 0.10  # and a program may leave at most this much more of its step to collectives


@dataclasses.dataclass(frozen=True)
class Band:
    """Measured / predicted over the comparable runs, widened to include 1."""

    lo: float
    hi: float
    runs: tuple[MeasuredRun, ...]

    def text(self) -> str:
        names = ", ".join(r.name for r in self.runs)
        lo, hi = min(r.ratio for r in self.runs), max(r.ratio for r in self.runs)
        many = f"{len(self.runs)} published runs" if len(self.runs) > 1 else "1 published run"
        ratios = f"{lo:.2f}–{hi:.2f}" if hi > lo else f"{lo:.2f}"
        return f"{many} of similar per-chip work ({names}) measured {ratios}× such predictions"


def band(compute_s: float, exposed_share: float, runs=RUNS) -> Band | None:
    """The band for a program of `compute_s` compute per chip per step leaving `exposed_share` of its step to
    collectives; None where the back-test has no comparable run."""
    if compute_s <= 0:
        return None
    near = tuple(r for r in runs if abs(math.log(r.compute_s / compute_s)) <= math.log(COMPARABLE_WORK))
    if not near or exposed_share > max(r.exposed_share for r in near) + COMPARABLE_COLLECTIVES:
        return None
    return Band(min(1.0, *(r.ratio for r in near)), max(1.0, *(r.ratio for r in near)), near)


def span(runs=RUNS) -> str:
    """The regime the back-test covers, for the message that names none."""
    lo, hi = min(r.compute_s for r in runs), max(r.compute_s for r in runs)
    return f"{lo * 1e3:.0f} ms–{hi:.1f} s of compute per chip per step"
