"""Choosing a preset's layout for a TPU topology by compiling candidates: `plan.py --config P --topology T --search`.

A candidate is the preset with a few fields changed along five axes — the attention kernel, the sharding layout
(rules and mesh shape), the micro-batch (train.grad_accum), the remat policy and scanned vs unrolled layers.
Each is compiled for the topology by planning/aot.py, as `plan.py` without `--search` would, with
train.steps_per_call=1 (the estimate is per optimizer step and the K-step scan only repeats it: a 10-step call of
gpt2_124m gives the same FLOPs and collectives per step and HBM traffic within 0.6 %), and ranked by its predicted
step time (planning/step_time.py).

A full grid would be hundreds of compiles of 30 s–10 min each. The search is coordinate descent instead, in one
pass: starting from the preset, it tries the values of one axis with the others held, keeps the best, and moves
to the next axis. Two prunings follow from how the step's cost is made: the micro-batch is walked only towards
more rows while the candidate fits (fewer micro-batches never cost more FLOPs, collectives or overheads) and
towards fewer rows only until one fits; a remat policy, which only adds recomputation, is tried on a fitting
candidate without remat only together with the next larger micro-batch (the one thing it can buy). It stops
starting compiles after `budget_s` seconds (a compile under way finishes). Every candidate is a row of the
table: one that does not fit or fails to compile is ranked last, with the reason.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Iterable

import jax
from tqdm.auto import tqdm

from configs.base import Config
from configs.plan import PlanConfig
from errors import ConfigError
from planning.aot import (DoesNotFit, LoweredCall, chip_of, compile_for_topology, for_topology, lower_train_call,
                          parse_topology, topology_devices)
from planning.compile_store import STORE
from planning.compile_time import minutes

# The axes in the order the descent visits them, those that change a step's largest costs first (per-micro-batch
# gradient collectives and overheads, recomputation, the scan's saved activations), so that a search cut short
# by its budget has spent its compiles where the gains are; the micro-batch again last, since remat, scan and
# attention change the memory a micro-batch needs.
AXES = ("micro_batch", "remat", "scan_layers", "layout", "attention", "micro_batch")
REMAT = ("none", "dots", "full")
MICRO_ROWS = (1, 2, 4, 8, 16, 32, 64)  # sequences per chip per micro-batch

Changes = tuple[tuple[str, object], ...]  # (dotted config field, value), sorted: a candidate's identity


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What compiling one candidate gave: its figures, or why it has none."""

    changes: Changes  # vs the preset
    fits: bool
    memory_bytes: float | None  # per chip: arguments + outputs + temporaries (the compiler's figure if refused)
    step_s: float | None  # predicted step time (StepTimeEstimate.predicted_s)
    mfu: float | None  # predicted MFU
    bottleneck: str
    compile_s: float
    error: str | None = None  # "does not fit: ..." or the compile's first error line
    from_store: bool = False  # read back from an earlier compile (planning/compile_store.py)
    mfu_causal: float | None = None  # predicted MFU counting causal attention only (MaxText's, llm.c's convention)
    expected: str | None = None  # the step and MFU range the back-test gives, or why none (StepTimeEstimate)
    tokens_per_chip: float = 0.0  # per step

    def key(self) -> tuple:
        """Sort key, best first: fitting and fast, then not fitting by memory (so the search moves towards
        fitting), then failures."""
        if self.fits and self.step_s is not None:
            return (0, self.step_s)
        if self.memory_bytes is not None:
            return (1, self.memory_bytes)
        return (2, 0.0)


def flags(changes: Changes) -> str:
    """The command-line flags of a candidate's changes."""
    def value(v):
        return str(v).lower() if isinstance(v, bool) else str(v)
    return " ".join(f"--{k}={value(v)}" for k, v in changes) or "(the preset as it is)"


def apply(cfg: Config, changes: Iterable[tuple[str, object]]) -> Config:
    """`cfg` with dotted fields (`model.remat`, `mesh.data`, ...) replaced."""
    for path, value in changes:
        section, field = path.split(".")
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{field: value})})
    return cfg


# ---------------------------------------------------------------------------------------------- the axes

def layouts(cfg: Config, devices: int) -> list[dict[str, object]]:
    """Sharding rules with mesh shapes that fit `devices` chips and the model's shapes.

    fsdp splits the width (n_embd) over as many chips as divide it, the rest is data parallel; tp splits heads,
    mlp and vocabulary over 2 chips (more only adds collectives at GPT-2's widths); fsdp_tp does both. Over several
    slices (mesh.num_slices) fsdp and tensor stay inside one slice's chips; data spans the slices.
    """
    D, H, V = cfg.model.n_embd, cfg.model.n_head, cfg.model.padded_vocab_size
    per_slice = devices // cfg.mesh.num_slices

    def mesh(rules, data, fsdp, tensor):
        return {"mesh.rules": rules, "mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor}

    def fsdp_size(n):  # the largest divisor of n that splits the width
        return max(f for f in range(1, n + 1) if n % f == 0 and D % f == 0)

    out = [mesh("dp", devices, 1, 1)]
    f = fsdp_size(per_slice)
    if f > 1:
        out.append(mesh("fsdp", devices // f, f, 1))
    if per_slice % 2 == 0 and H % 2 == 0 and V % 2 == 0:
        out.append(mesh("tp", devices // 2, 1, 2))
    if per_slice % 2 == 0 and H % 2 == 0 and fsdp_size(per_slice // 2) > 1:
        f = fsdp_size(per_slice // 2)
        out.append(mesh("fsdp_tp", devices // 2 // f, f, 2))
    return out


def batch_shards(cfg: Config, devices: int) -> int:
    """Chips the batch is split over: data × fsdp (the remaining factor of the device count is tensor)."""
    m = cfg.mesh
    if -1 in (m.data, m.fsdp):
        return devices // m.tensor if m.tensor != -1 else m.data * m.fsdp
    return m.data * m.fsdp


def micro_batches(cfg: Config, devices: int) -> list[dict[str, object]]:
    """grad_accum values giving MICRO_ROWS sequences per chip per micro-batch, fewest rows first."""
    B, shards = cfg.train.batch_size, batch_shards(cfg, devices)
    out = []
    for rows in MICRO_ROWS:
        if B % (rows * shards) == 0:
            out.append({"train.grad_accum": B // (rows * shards)})
    return out


def options(axis: str, cfg: Config, devices: int) -> list[dict[str, object]]:
    if axis == "attention":
        return [{"model.attention": a} for a in ("xla", "splash")]
    if axis == "layout":
        return layouts(cfg, devices)
    if axis == "micro_batch":
        return micro_batches(cfg, devices)
    if axis == "remat":
        return [{"model.remat": r} for r in REMAT]
    if axis == "scan_layers":
        return [{"model.scan_layers": s} for s in (True, False)]
    raise ValueError(axis)


def most_compiles(cfg: Config, devices: int) -> int:
    """The most candidates a search from `cfg` compiles: the preset, then every other value of each axis it visits
    (the micro-batch's second pass counted in full, as the layout it follows may offer other sizes)."""
    return 1 + sum(len(options(axis, cfg, devices)) - 1 for axis in AXES)


def axes_text(cfg: Config, devices: int) -> str:
    """The axes the search walks and their values, in the order it visits them."""
    def values(axis):
        opts = options(axis, cfg, devices)
        if axis == "micro_batch":
            return "train.grad_accum " + ", ".join(str(o["train.grad_accum"]) for o in opts)
        if axis == "layout":
            return ", ".join(f"{o['mesh.rules']}" for o in opts)
        return ", ".join(str(v).lower() for o in opts for v in o.values())
    seen, parts = set(), []
    for axis in AXES:
        parts.append(f"{axis} again" if axis in seen else f"{axis} ({values(axis)})")
        seen.add(axis)
    return ", ".join(parts)


# ---------------------------------------------------------------------------------------------- the search

@dataclasses.dataclass
class Plan:
    topology: str
    outcomes: dict[Changes, Outcome]  # every candidate compiled, in order
    best: Changes
    budget_s: float
    elapsed_s: float
    stopped_by_budget: bool
    preset: str = "the config"  # the --config it searched around, as the verdict names it

    def ranked(self) -> list[Outcome]:
        return sorted(self.outcomes.values(), key=Outcome.key)


Compile = Callable[[Config, Changes], Outcome]


class Search:
    """Coordinate descent over AXES from `start` (the preset), compiling each candidate once through `compile`."""

    def __init__(self, preset: Config, devices: int, compile: Compile, *, budget_s: float, progress=None):
        self.preset, self.devices, self.compile = preset, devices, compile
        self.budget_s, self.progress = budget_s, progress
        self.outcomes: dict[Changes, Outcome] = {}
        self.started = time.monotonic()
        self.stopped_by_budget = False

    def run(self) -> Changes:
        current, best = {}, self.evaluate({})
        for axis in AXES:
            current, best = self.descend(axis, current, best)
        return best.changes

    def descend(self, axis: str, current: dict, best: Outcome) -> tuple[dict, Outcome]:
        opts = options(axis, apply(self.preset, current.items()), self.devices)
        if axis == "micro_batch":
            return self.walk(opts, current, best)
        if axis == "remat" and best.fits and self.value("model.remat", current) == "none":
            # remat only adds recomputation at the same micro-batch: it can pay only by fitting a larger one
            larger = self.larger_micro_batch(current)
            opts = [{**o, **larger} for o in opts if o["model.remat"] != "none"] if larger else []
        for opt in opts:
            outcome = self.evaluate({**current, **opt})
            if outcome is not None and outcome.key() < best.key():
                current, best = {**current, **opt}, outcome
        return current, best

    def walk(self, opts: list[dict], current: dict, best: Outcome) -> tuple[dict, Outcome]:
        """Along the micro-batch sizes from the current one: towards more rows per micro-batch while each step is
        faster and fits (fewer micro-batches: the same FLOPs with fewer per-micro-batch collectives and
        overheads, so never slower for a fitting candidate), or towards fewer rows until one fits."""
        here = self.position(opts, current)
        step = +1 if best.fits else -1
        i = here + step if here is not None else (0 if step > 0 else len(opts) - 1)
        while 0 <= i < len(opts):
            outcome = self.evaluate({**current, **opts[i]})
            if outcome is None or outcome.key() >= best.key():
                break
            current, best = {**current, **opts[i]}, outcome
            i += step
        return current, best

    def larger_micro_batch(self, current: dict) -> dict | None:
        """The next micro-batch size up from the current one, or None."""
        opts = micro_batches(apply(self.preset, current.items()), self.devices)
        here = self.position(opts, current)
        return opts[here + 1] if here is not None and here + 1 < len(opts) else None

    def position(self, opts: list[dict], current: dict) -> int | None:
        return next((i for i, o in enumerate(opts) if all(self.value(k, current) == v for k, v in o.items())), None)

    def value(self, path: str, current: dict):
        if path in current:
            return current[path]
        section, field = path.split(".")
        return getattr(getattr(self.preset, section), field)

    def evaluate(self, changes: dict) -> Outcome | None:
        """The outcome of the preset with `changes` (compiled once; None once the budget is spent)."""
        key = self.normalize(changes)
        if key in self.outcomes:
            return self.outcomes[key]
        if self.outcomes and time.monotonic() - self.started > self.budget_s:
            self.stopped_by_budget = True
            return None
        if self.progress is not None:
            self.progress.set_postfix_str(self.status(key))
        outcome = self.compile(apply(self.preset, key), key)
        self.outcomes[key] = outcome
        if self.progress is not None:
            self.progress.update(1)
        return outcome

    def status(self, key: Changes) -> str:
        """The progress bar's: the time that may be left, and the candidate it compiles now."""
        left = self.time_left_s(self.progress.total)
        now = f"compiling {flags(key)[:60]}"
        return now if left is None else f"{minutes(left).replace('about', 'up to about')} left; {now}"

    def time_left_s(self, most: int | None) -> float | None:
        """Up to how long the rest may take at the pace the compiles so far have kept: the candidates that may be
        left (of `most`), or the rest of the budget and the compile it lets start, whichever is sooner."""
        took = [o.compile_s for o in self.outcomes.values() if not o.from_store]
        if not took or most is None:
            return None
        pace = sum(took) / len(took)
        budget_left = max(self.budget_s - (time.monotonic() - self.started), 0.0)
        return min(max(most - len(self.outcomes), 0) * pace, budget_left + pace)

    def normalize(self, changes: dict) -> Changes:
        """Only the fields that differ from the preset, sorted: the same candidate reached twice is one."""
        return tuple(sorted((k, v) for k, v in changes.items() if self.value(k, {}) != v))


def compile_candidate(topology: str, first: tuple[Config, LoweredCall] | None = None) -> Compile:
    """Compiles a candidate for `topology` (steps_per_call=1) into an Outcome; failures become rows. `first`: a
    candidate's config (steps_per_call=1) already lowered, as `run_plan` lowers the preset to size the search."""
    def compile(cfg: Config, changes: Changes) -> Outcome:
        cfg = apply(cfg, [("train.steps_per_call", 1)])
        start = time.monotonic()
        try:
            lowered = first[1] if first is not None and first[0] == cfg else None
            r = compile_for_topology(cfg, topology, lowered=lowered)
        except DoesNotFit as e:
            return Outcome(changes, False, e.required_bytes, None, None, "-", time.monotonic() - start,
                           "does not fit: " + str(e).split("does not fit in HBM: ", 1)[-1])
        except Exception as e:  # noqa: BLE001 - a candidate that fails to compile is a row, not a crash
            text = str(e).strip().splitlines()
            return Outcome(changes, False, None, None, None, "-", time.monotonic() - start,
                           f"{type(e).__name__}: {text[0] if text else ''}"[:200])
        finally:
            jax.clear_caches()  # each candidate's executables are not needed again
        e = r.step_time
        return Outcome(changes, r.fits, float(r.total_bytes), e.predicted_s, e.predicted_mfu, e.bottleneck,
                       time.monotonic() - start, None if r.fits else "does not fit in HBM", r.from_store,
                       e.predicted_mfu_causal, e.expected_range(), r.tokens_per_step / r.devices)

    return compile


def plan(cfg: Config, topology: str, *, budget_s: float, compile: Compile | None = None,
         show_progress: bool = True, preset: str = "the config") -> Plan:
    """Searches candidates around `cfg` for `topology`; `compile` defaults to compiling through libtpu."""
    chip_of(topology)  # an unknown generation is one line, before anything compiles
    devices = len(topology_devices(topology)) if compile is None else _devices(topology)
    cfg = _resolved(for_topology(cfg, topology), devices)
    # no rate or ETA of tqdm's own: the total is an upper bound, and the budget may end the search sooner
    with tqdm(desc=f"plan {topology}", total=most_compiles(cfg, devices), disable=not show_progress, leave=False,
              bar_format="{desc}: {n} of at most {total} candidates, {elapsed}{postfix}") as bar:
        search = Search(cfg, devices, compile or compile_candidate(topology), budget_s=budget_s, progress=bar)
        best = search.run()
    return Plan(topology, search.outcomes, best, budget_s, time.monotonic() - search.started,
                search.stopped_by_budget, preset)


def _devices(topology: str) -> int:
    """Chips in a topology name, e.g. v5e:2x4 -> 8, v5e:2x4*2 -> 16 (for a search with a stand-in compiler)."""
    name, slices = parse_topology(topology)
    return math.prod(int(d) for d in name.split(":")[1].split("x")) * slices


def _resolved(cfg: Config, devices: int) -> Config:
    """The preset with `auto` choices made as they are for a TPU target (attention=auto is splash there) and
    the mesh's -1 ("the rest") resolved, so that a candidate equal to the preset is recognized as it."""
    if cfg.model.attention == "auto":
        cfg = apply(cfg, [("model.attention", "splash")])
    m = cfg.mesh
    sizes = {"data": m.data, "fsdp": m.fsdp, "tensor": m.tensor}
    free = [a for a, v in sizes.items() if v == -1]
    if free:
        fixed = math.prod(v for v in sizes.values() if v != -1)
        cfg = apply(cfg, [(f"mesh.{free[0]}", devices // fixed)])
    return cfg


# ---------------------------------------------------------------------------------------------- the report

def table(p: Plan) -> str:
    gib = lambda b: f"{b / 2**30:5.2f}" if b is not None else "    ?"  # noqa: E731
    pct = lambda x: f"{x:6.1%}" if x is not None else "     -"  # noqa: E731
    rows = [f"{'#':>2}  {'fits':4}  {'GiB/chip':>8}  {'step ms':>8}  {'MFU':>6}  {'causal':>6}  {'compile':>7}"
            "  bottleneck / changes"]
    for i, o in enumerate(p.ranked(), 1):
        fits = "yes" if o.fits else "no"
        step = f"{o.step_s * 1e3:8.1f}" if o.step_s is not None else "       -"
        why = o.bottleneck if o.error is None else o.error
        took = " stored" if o.from_store else f"{o.compile_s:6.0f}s"
        rows.append(f"{i:>2}  {fits:4}  {gib(o.memory_bytes):>8}  {step}  {pct(o.mfu)}  {pct(o.mfu_causal)}"
                    f"  {took:>7}  {why}")
        rows.append(f"{'':>2}  {'':4}  {'':>8}  {'':>8}  {'':>6}  {'':>6}  {'':>7}  {flags(o.changes)}")
    return "\n".join(rows)


def verdict(p: Plan, hbm_bytes: float) -> list[str]:
    """The best candidate first: what to change, whether it fits, its step with its range, tokens/s, MFU."""
    best = p.outcomes[p.best]
    if not best.fits:
        return [f"No candidate for --config {p.preset} fits {p.topology}: shard more (a larger topology) or shrink"
                " train.batch_size."]
    gib = 2**30
    lines = [
        f"Best for --config {p.preset} on {p.topology}, predicted from its compiled program, not measured:",
        f"  flags       {flags(p.best)}",
        f"  fits        yes, {best.memory_bytes / gib:.2f} of {hbm_bytes / gib:.2f} GiB HBM per chip"
        f" ({(hbm_bytes - best.memory_bytes) / gib:.2f} GiB to spare)",
        f"  step        {best.step_s * 1e3:.1f} ms" + (f"; {best.expected}" if best.expected else ""),
        f"  tokens/s    {best.tokens_per_chip / best.step_s:,.0f} per chip",
    ]
    if best.mfu is not None:
        lines.append(f"  MFU         {best.mfu:.1%} counting 6N + attention over every query-key pair (PaLM, nanoGPT)"
                     + (f"; {best.mfu_causal:.1%} counting the causal pairs only (MaxText, llm.c)"
                        if best.mfu_causal else ""))
    lines.append(f"  bottleneck  {best.bottleneck}")
    return lines


def text(p: Plan, hbm_bytes: float) -> str:
    budget = (f"stopped at the budget of {p.budget_s:.0f} s" if p.stopped_by_budget
              else f"within the budget of {p.budget_s:.0f} s")
    return "\n".join([
        *verdict(p, hbm_bytes),
        "",
        f"{len(p.outcomes)} candidate{'s' * (len(p.outcomes) > 1)} compiled in {p.elapsed_s:.0f} s"
        f" ({budget}; --budget SECONDS): a coordinate descent from the preset, one pass over " + ", ".join(AXES)
        + ", one axis at a time with the others held at the best so far; not a full grid.",
        "Figures per chip, predicted from each compiled program (train.steps_per_call=1), not measured. step ms:"
        " ops in series, each at max(its FLOPs, its HBM bytes) at libtpu's cost model's rates, plus their fixed"
        " costs and the collectives the schedule leaves exposed. MFU: 6N + attention over every query-key pair"
        " (PaLM, nanoGPT); causal: counting only the causal pairs (MaxText, llm.c).",
        table(p),
    ])


def intro(cfg: Config, devices: int, topology: str, budget_s: float, lowered: LoweredCall | None,
          preset: str = "the config") -> str:
    """What the search will do and how long it may take, said before it starts: `cfg` is the preset resolved for
    the topology, `lowered` its train call (one step per call) lowered — its size says how long a compile takes —
    or None where the preset does not build for the topology."""
    most = most_compiles(cfg, devices)
    plan = (f"Planning --config {preset} for {topology} ({devices} chip{'s' * (devices > 1)}): a coordinate descent"
            f" from the preset, one axis at a time, over {axes_text(cfg, devices)}: at most {most} candidates, each"
            " compiled once.")
    keep = (f"{STORE} keeps every compile: a re-run reads them back in seconds and goes on where this one"
            " stopped.")
    if lowered is None:
        return (f"{plan} The preset does not build for {topology}; the progress bar gives the time left once a"
                f" candidate has compiled. --budget stops it starting compiles after {budget_s:g} s. {keep}")
    each, basis = lowered.expected()
    total = min(most * each, budget_s + each)
    ends = "in under a minute" if total < 45 else f"within {minutes(total)}"
    stored = "; the preset's own is stored" if lowered.stored else ""
    return (f"{plan} A compile of the preset's size should take {minutes(each)} here ({basis}{stored}); --budget stops"
            f" it starting compiles after {budget_s:g} s, so it ends {ends}. {keep}")


def run_plan(cfg: PlanConfig, preset: str = "the config") -> int:
    """`plan.py --config P --topology T --search [--budget SECONDS]`: says what it will do and how long it may
    take, searches, prints the best candidate's verdict and the table."""
    _, chip = chip_of(cfg.topology)
    devices = len(topology_devices(cfg.topology))
    start = _resolved(for_topology(cfg.run, cfg.topology), devices)
    first = apply(start, [("train.steps_per_call", 1)])  # as compile_candidate compiles it
    try:
        lowered = lower_train_call(first, cfg.topology)  # its size: how long a compile takes
    except Exception:  # noqa: BLE001 - the search makes it a row with the reason, and tries the other layouts
        lowered = None
    print(intro(start, devices, cfg.topology, cfg.budget, lowered, preset), flush=True)
    p = plan(cfg.run, cfg.topology, budget_s=cfg.budget, preset=preset,
             compile=compile_candidate(cfg.topology, (first, lowered) if lowered else None))
    print(text(p, chip.hbm_bytes))
    if not p.outcomes[p.best].fits:
        raise ConfigError(f"--topology {cfg.topology}: no candidate fits")
    return 0
