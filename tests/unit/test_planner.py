"""The planner (planning/planner.py): the search and its report on a stand-in compiler whose figures are known
(milliseconds), the candidate axes for the presets' topologies, and a bad budget. A real plan through plan.py:
tests/e2e/test_planner.py."""

import dataclasses

import pytest

import configs
import plan as plan_app
from planning import planner
from planning.planner import Outcome
from support.cli import last_line, run_main

GiB = 2**30


def stand_in(c, changes):
    """A compiler with known figures: memory grows with rows per chip (dense attention doubles it, remat
    shrinks it), time grows with micro-batches, remat, scanning and any layout but dp; tp fails to compile."""
    if c.mesh.rules == "tp":
        return Outcome(changes, False, None, None, None, "-", 0.0, "RuntimeError: no")
    m, rows = c.model, c.train.batch_size // c.train.grad_accum // (c.mesh.data * c.mesh.fsdp)
    memory = rows * (2 if m.attention == "xla" else 1) * {"none": 3, "dots": 2, "full": 0.5}[m.remat] * GiB
    step = (0.3 + 0.01 * c.train.grad_accum + {"none": 0, "dots": 0.05, "full": 0.1}[m.remat]
            + 0.02 * m.scan_layers + 0.05 * (c.mesh.rules != "dp"))
    fits = memory <= 16 * GiB
    return Outcome(changes, fits, memory, step if fits else None, 0.25 / step if fits else None, "compute", 0.0,
                   None if fits else "does not fit", tokens_per_chip=c.train.batch_size * c.train.seq_len / 8)


def start(**model):
    """gpt2_124m as it was before the planner chose its settings: 16 micro-batches of 4 rows per chip on 8,
    no remat, scanned, dp."""
    cfg = planner.apply(configs.load("gpt2_124m"), [("train.grad_accum", 16), ("mesh.rules", "dp"),
                                                    ("mesh.data", -1), ("mesh.fsdp", 1), ("mesh.tensor", 1)])
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **{"remat": "none", "scan_layers": True,
                                                                         "attention": "auto", **model}))


def test_the_search_changes_one_axis_at_a_time_and_ranks_every_candidate():
    p = planner.plan(start(), "v5e:2x4", budget_s=60, compile=stand_in, show_progress=False, preset="gpt2_124m")
    # the preset: 16 micro-batches of 4 rows per chip (12 GiB), splash, dp, no remat, scanned: 480 ms. 8 rows
    # do not fit (24 GiB) but do with remat=dots (16 GiB, 450 ms); unrolled: 430 ms. Dense attention, 16 rows,
    # fsdp and fsdp_tp do not fit or are slower; tp fails
    assert dict(p.best) == {"model.remat": "dots", "train.grad_accum": 8, "model.scan_layers": False}
    ranked = p.ranked()
    assert ranked[0].changes == p.best
    assert [o.key() for o in ranked] == sorted(o.key() for o in ranked)
    fitting = [o for o in ranked if o.fits]
    assert ranked[:len(fitting)] == fitting  # fitting candidates first, fastest first
    assert ranked[-1].error == "RuntimeError: no"  # a failed compile is a row, last
    # coordinate descent, not a grid: 2 attention × 4 layouts × 7 micro-batches × 3 remat × 2 scan = 336
    assert len(p.outcomes) <= 15
    text = planner.text(p, 16 * GiB)
    assert "coordinate descent" in text and "not a full grid" in text and "within the budget of 60 s" in text
    assert text.count("\n") >= 2 * len(p.outcomes)  # every candidate a row, with its flags under it
    lines = text.splitlines()  # the verdict first: the best candidate's flags, fit, step, tokens/s, MFU
    assert lines[0] == "Best for --config gpt2_124m on v5e:2x4, predicted from its compiled program, not measured:"
    assert lines[1] == "  flags       --model.remat=dots --model.scan_layers=false --train.grad_accum=8"
    assert lines[2] == "  fits        yes, 16.00 of 16.00 GiB HBM per chip (0.00 GiB to spare)"
    assert lines[3] == "  step        430.0 ms"
    assert lines[4] == f"  tokens/s    {512 * 1024 / 8 / 0.43:,.0f} per chip"
    assert lines[5].startswith("  MFU         58.1% counting 6N + attention over every query-key pair")
    assert "does not fit" in text and "RuntimeError: no" in text


def test_the_walk_along_micro_batches_moves_while_it_helps():
    # with remat=full a micro-batch of 16 rows fits (8 GiB) and fewer micro-batches are faster
    p = planner.plan(start(remat="full"), "v5e:2x4", budget_s=60, compile=stand_in, show_progress=False)
    best = dict(p.best)
    assert best["train.grad_accum"] == 2 and best["model.scan_layers"] is False  # 32 rows: 16 GiB, just fits
    assert p.outcomes[p.best].memory_bytes == 16 * GiB


def test_the_budget_stops_new_compiles_after_the_first():
    p = planner.plan(start(), "v5e:2x4", budget_s=1e-9, compile=stand_in, show_progress=False)
    assert list(p.outcomes) == [()] and p.stopped_by_budget
    assert "stopped at the budget" in planner.text(p, 16 * GiB)


def test_layouts_fit_each_topology_and_model():
    def meshes(name, devices):
        cfg = planner._resolved(configs.load(name), devices)
        return [(o["mesh.rules"], o["mesh.data"], o["mesh.fsdp"], o["mesh.tensor"])
                for o in planner.layouts(cfg, devices)]

    assert meshes("gpt2_124m", 8) == [("dp", 8, 1, 1), ("fsdp", 1, 8, 1), ("tp", 4, 1, 2), ("fsdp_tp", 1, 4, 2)]
    # 1600 wide, 25 heads: FSDP over 64 chips (the largest split of the width), no tensor parallelism
    assert meshes("gpt2_xl_pod", 256) == [("dp", 256, 1, 1), ("fsdp", 4, 64, 1)]


def test_micro_batch_options_follow_the_layout():
    cfg = planner._resolved(start(), 8)  # 512 rows over 8 chips
    assert [o["train.grad_accum"] for o in planner.micro_batches(cfg, 8)] == [64, 32, 16, 8, 4, 2, 1]


def test_a_bad_budget_is_one_line():
    code, _, err = run_main(plan_app.main, "--config", "gpt2_124m", "--topology", "v5e:2x4", "--search", "--budget", "0")
    assert code == 2
    assert last_line(err) == "error: --budget must be a finite number > 0, got 0.0"


class Lowered:
    """The preset's lowered train call as the search's introduction reads it: whether it is stored, how long its
    compile may take here."""

    def __init__(self, seconds, stored=False):
        self.seconds, self.stored = seconds, stored

    def expected(self):
        return self.seconds, "a fit to compiles on a 2-core machine"


def test_the_search_says_up_front_what_it_compiles_how_many_and_for_how_long():
    cfg = planner._resolved(configs.load("gpt2_124m"), 8)
    most = planner.most_compiles(cfg, 8)
    assert most == 1 + 6 + 2 + 1 + 3 + 1 + 6  # the preset, then every other value of each axis
    line = planner.intro(cfg, 8, "v5e:2x4", 600, Lowered(150.0), "gpt2_124m")
    assert line.startswith("Planning --config gpt2_124m for v5e:2x4 (8 chips): a coordinate descent from the preset,"
                           " one axis at a time, over micro_batch (train.grad_accum 64, 32, 16, 8, 4, 2, 1), remat"
                           " (none, dots, full), scan_layers (true, false), layout (dp, fsdp, tp, fsdp_tp), attention"
                           " (xla, splash), micro_batch again: at most 20 candidates, each compiled once.")
    # 20 compiles of 2.5 min would be 50: the budget's 10 min and the compile under way when it runs out
    assert ("A compile of the preset's size should take about 2.5 min here (a fit to compiles on a 2-core machine);"
            " --budget stops it starting compiles after 600 s, so it ends within about 12 min.") in line
    assert line.endswith("a re-run reads them back in seconds and goes on where this one stopped.")
    # a small search ends before its budget: 20 compiles of 6 s
    assert "so it ends within about 2.0 min." in planner.intro(cfg, 8, "v5e:2x4", 600, Lowered(6.0))
    assert "; the preset's own is stored)" in planner.intro(cfg, 8, "v5e:2x4", 600, Lowered(6.0, stored=True))


def test_the_time_left_follows_the_compiles_pace_and_the_budget():
    search = planner.Search(start(), 8, stand_in, budget_s=100)
    search.outcomes = {(): Outcome((), True, 1.0, 0.3, 0.5, "compute", 30.0),
                       (("model.remat", "dots"),): Outcome((), True, 1.0, 0.3, 0.5, "compute", 0.5, from_store=True)}
    search.started -= 50  # 50 s of the 100 spent
    assert search.time_left_s(4) == pytest.approx(2 * 30)  # two candidates left, at the 30 s a compile has taken
    assert search.time_left_s(20) == pytest.approx(50 + 30, abs=1)  # the budget's 50 s and the compile it starts
