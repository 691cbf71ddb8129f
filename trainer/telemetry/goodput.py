"""Goodput: where a run's wall-clock time went, across every attempt (a start, a preemption, a crash, a restart).

    python -m tools.goodput runs/shakespeare_cpu        # the report of any run directory, any time

The report replays events.jsonl (trainer/telemetry/timeline.py writes it): a train call's steps are lost when a
later attempt restores, or a rollback returns to, a checkpoint before them; goodput is the time of the train calls
whose steps survive into the final trajectory (less the steps the spike guard skipped) over the wall time, from
the first attempt's start to the last record.
"""

from __future__ import annotations

import dataclasses

from trainer.storage.run_dir import RunDir
from trainer.telemetry.timeline import INTERVALS


@dataclasses.dataclass
class Report:
    wall: float = 0.0  # first attempt's start to the last record, less `idle`, seconds
    idle: float = 0.0  # between a finished attempt and the next (an extension of the run): not the run's time
    attempts: list[dict] = dataclasses.field(default_factory=list)  # how each ended
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # by category
    good_steps: int = 0
    lost_steps: int = 0
    skipped_steps: int = 0
    relaunches: int = 0  # by the pod launcher (tools/pod), after a preemption or failure
    compiles: list[dict] = dataclasses.field(default_factory=list)

    @property
    def goodput(self) -> float:
        return self.seconds.get("train", 0.0) / self.wall if self.wall else 0.0

    @property
    def unaccounted(self) -> float:
        return self.wall - sum(self.seconds.values())

    def text(self) -> str:
        ends = ", ".join(f"{a['attempt']}: {a['how']}" for a in self.attempts)
        lines = [f"goodput  {self.goodput:.1%} of {_duration(self.wall)} wall time over {len(self.attempts)}"
                 f" attempt(s) ({ends}); {self.good_steps:,} steps kept, {self.lost_steps:,} lost,"
                 f" {self.skipped_steps:,} skipped"
                 + (f"; {self.relaunches} relaunch(es) by tools.pod" if self.relaunches else "")]
        for name, value in sorted(self.seconds.items(), key=lambda kv: -kv[1]):
            if value > 0:
                lines.append(f"  {name:<17}{_duration(value):>10}  {value / self.wall:6.1%}")
        lines.append(f"  {'unaccounted':<17}{_duration(self.unaccounted):>10}  {self.unaccounted / self.wall:6.1%}"
                     "  (host work between the recorded intervals)")
        if self.idle:
            lines.append(f"  not counted: {_duration(self.idle)} idle between a finished attempt and its extension")
        programs = sum(sum(c.get("programs", {}).values()) for c in self.compiles)
        hits = sum(sum(c.get("cache_hits", {}).values()) for c in self.compiles)
        if programs:
            lines.append(f"  compiles: {programs} programs, {hits} loaded from the persistent cache")
        return "\n".join(lines)

    def summary(self) -> dict[str, float]:
        """Flat figures for wandb's run summary."""
        figures = {"goodput/goodput": self.goodput, "goodput/wall_s": self.wall, "goodput/idle_s": self.idle,
                   "goodput/lost_steps": self.lost_steps, "goodput/attempts": len(self.attempts),
                   "goodput/relaunches": self.relaunches}
        figures.update({f"goodput/{name}_s": value for name, value in self.seconds.items()})
        return figures


def _duration(seconds: float) -> str:
    h, rest = divmod(max(seconds, 0.0), 3600)
    return f"{int(h)}h{int(rest // 60):02d}m{rest % 60:04.1f}s" if h else f"{rest // 60:.0f}m{rest % 60:04.1f}s"


def report(records: list[dict]) -> Report:
    """Replays events.jsonl's records (in file order) into a Report."""
    out, live = Report(), []  # live: train calls whose steps are still in the trajectory
    seconds: dict[str, float] = {name: 0.0 for name in ("train", "lost", "skipped", "compile", "restart_gap",
                                                        *INTERVALS)}
    starts = [r for r in records if r["event"] == "attempt_start"]
    if not starts:
        return out
    every_compile = [r for r in records if r["event"] == "interval" and r["kind"] == "compile"]
    # compile time is the main thread's: its compiles and its waits for a compile ahead; a compile on the thread that
    # compiles ahead (trainer/program/ahead.py) ran beside whatever the main thread did, which keeps that time
    compiles = [r for r in every_compile if not r.get("background")]
    last_end, finished = starts[0]["time"], False
    for r in records:
        if r["event"] == "relaunch":  # the launcher's note: the restart gap runs on to the next attempt's start
            out.relaunches += 1
            continue
        if r["event"] == "attempt_start" and r["attempt"] > 1:
            gap = max(0.0, r["time"] - last_end)
            if finished:  # the run had ended; starting it again later extends it, and nothing was lost meanwhile
                out.idle += gap
            else:
                seconds["restart_gap"] += gap
        elif r["event"] == "attempt_end":
            finished = r["how"] == "finished"
        elif r["event"] in ("restored", "rolled_back"):
            out.lost_steps += _drop_after(live, r["step"], seconds)
        elif r["event"] == "train_call":  # the first call's dispatch compiles: that is compile time
            span = {"start": r.get("start", r["end"] - r["seconds"]), "end": r["end"]}  # older files: no start
            excluded = [{"start": r["excluded"][0], "end": r["excluded"][1]}] if "excluded" in r else []
            live.append({**r, "seconds": _outside(span, compiles + excluded)})
        elif r["event"] == "interval" and r["kind"] != "compile":
            seconds[r["kind"]] = seconds.get(r["kind"], 0.0) + _outside(r, compiles)
        last_end = max(last_end, r.get("end", r.get("time", last_end)))
    for call in live:
        share = call["seconds"] * call["skipped"] / call["steps"]
        seconds["skipped"] += share
        seconds["train"] += call["seconds"] - share
        out.good_steps += call["steps"] - call["skipped"]
        out.skipped_steps += call["skipped"]
    seconds["compile"] = _union(compiles)
    out.wall = last_end - starts[0]["time"] - out.idle
    out.seconds = seconds
    out.compiles = every_compile  # the programs: all of them
    out.attempts = _attempts(records)
    return out


def _drop_after(live: list[dict], step: int, seconds: dict) -> int:
    """Takes the steps after `step` out of the trajectory (a restore or rollback to it); returns how many."""
    lost = 0
    for call in list(live):
        end = call["first"] + call["steps"]
        if end <= step:
            continue
        gone = end - max(call["first"], step)
        seconds["lost"] += call["seconds"] * gone / call["steps"]
        lost += gone
        if call["first"] >= step:
            live.remove(call)
        else:  # a call straddling the checkpoint (not one the loop makes): keep its surviving share
            kept = call["steps"] - gone
            call.update(seconds=call["seconds"] * kept / call["steps"], steps=kept,
                        skipped=min(call["skipped"], kept))
    return lost


def _outside(interval: dict, others: list[dict]) -> float:
    """An interval's seconds less the parts of it the `others` (compilations: compile time) cover."""
    start, end = interval["start"], interval["end"]
    inside = [(max(start, c["start"]), min(end, c["end"])) for c in others if c["start"] < end and c["end"] > start]
    return max(0.0, end - start - _union([{"start": a, "end": b} for a, b in inside]))


def _union(spans: list[dict]) -> float:
    """Seconds covered by the spans (counted once where they overlap)."""
    total, reach = 0.0, float("-inf")
    for s in sorted(spans, key=lambda s: s["start"]):
        start, end = max(s["start"], reach), s["end"]
        if end > start:
            total += end - start
        reach = max(reach, end)
    return total


def _attempts(records: list[dict]) -> list[dict]:
    ended = {r["attempt"]: r["how"] for r in records if r["event"] == "attempt_end"}
    return [{"attempt": r["attempt"], "how": ended.get(r["attempt"], "crashed")}
            for r in records if r["event"] == "attempt_start"]


def read_events(run_dir) -> list[dict]:
    """The records of a run directory's events.jsonl (local or gs://)."""
    return RunDir(run_dir).read_events()
