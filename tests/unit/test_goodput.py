"""Goodput: the report's accounting on hand-written event records (lost steps, restart gaps, idle time before an
extension, crashes inferred, compilations carved out of the intervals they fall in). The real faults' figures are
checked where the faults are made (tests/e2e/test_faults.py, test_numerical_safety.py)."""

import json
import subprocess
import sys

import pytest

from support.cli import ROOT, read_jsonl
from tools import goodput as goodput_cli
from trainer.telemetry import goodput


def start(attempt, time):
    return {"event": "attempt_start", "attempt": attempt, "time": time}


def call(attempt, first, steps, seconds, end, skipped=0):
    return {"event": "train_call", "attempt": attempt, "first": first, "steps": steps, "seconds": seconds,
            "start": end - seconds, "end": end, "skipped": skipped}


def interval(attempt, kind, start, end, **fields):
    return {"event": "interval", "attempt": attempt, "kind": kind, "start": start, "end": end, **fields}


def test_a_crash_loses_exactly_the_steps_after_the_checkpoint_restored():
    records = [
        start(1, 0.0), interval(1, "startup", 0.0, 10.0), {"event": "restored", "attempt": 1, "step": 0},
        call(1, 0, 2, 4.0, 14.0), call(1, 2, 2, 4.0, 18.0), interval(1, "checkpoint", 18.0, 19.0),
        call(1, 4, 2, 4.0, 23.0, skipped=1),  # killed after step 6, the newest checkpoint at 4
        start(2, 33.0), interval(2, "startup", 33.0, 40.0), {"event": "restored", "attempt": 2, "step": 4},
        call(2, 4, 2, 4.0, 44.0), {"event": "attempt_end", "attempt": 2, "time": 45.0, "how": "finished"},
    ]
    r = goodput.report(records)
    assert [a["how"] for a in r.attempts] == ["crashed", "finished"]
    assert (r.lost_steps, r.good_steps, r.skipped_steps) == (2, 6, 0)
    assert r.wall == 45.0
    assert r.seconds["lost"] == 4.0 and r.seconds["train"] == 12.0
    assert r.seconds["restart_gap"] == 33.0 - 23.0  # from the last record of the dead attempt to the next start
    assert r.seconds["startup"] == 17.0 and r.seconds["checkpoint"] == 1.0
    assert r.unaccounted == pytest.approx(45.0 - 4 - 12 - 10 - 17 - 1)


def test_a_rollback_loses_the_abandoned_steps_and_skipped_steps_are_not_goodput():
    records = [
        start(1, 0.0), call(1, 0, 4, 8.0, 8.0), call(1, 4, 4, 8.0, 16.0, skipped=2),
        {"event": "rolled_back", "attempt": 1, "step": 4}, interval(1, "rollback", 16.0, 17.0),
        call(1, 4, 4, 8.0, 25.0, skipped=1), {"event": "attempt_end", "attempt": 1, "time": 25.0, "how": "finished"},
    ]
    r = goodput.report(records)
    assert (r.lost_steps, r.good_steps, r.skipped_steps) == (4, 7, 1)
    assert r.seconds["lost"] == 8.0 and r.seconds["skipped"] == 2.0 and r.seconds["train"] == 14.0
    assert r.goodput == pytest.approx(14.0 / 25.0)


def test_the_gap_before_extending_a_finished_run_is_idle_not_lost():
    """A run that finished, extended a day later: the day is neither the run's wall time nor a restart gap."""
    records = [
        start(1, 0.0), call(1, 0, 4, 8.0, 8.0), {"event": "attempt_end", "attempt": 1, "time": 9.0, "how": "finished"},
        start(2, 86_409.0), {"event": "restored", "attempt": 2, "step": 4}, call(2, 4, 4, 8.0, 86_418.0),
        {"event": "attempt_end", "attempt": 2, "time": 86_418.0, "how": "finished"},
    ]
    r = goodput.report(records)
    assert r.idle == 86_400.0 and r.seconds["restart_gap"] == 0.0 and r.wall == 18.0
    assert r.goodput == pytest.approx(16.0 / 18.0)
    assert "not counted: 24h00m00.0s idle between a finished attempt and its extension" in r.text()
    crashed = [rec for rec in records if not (rec["event"] == "attempt_end" and rec["attempt"] == 1)]
    assert goodput.report(crashed).seconds["restart_gap"] == 86_401.0  # after a crash the gap is lost time


def test_compilations_are_carved_out_of_the_intervals_they_fall_in():
    records = [
        start(1, 0.0), interval(1, "eval", 10.0, 20.0),
        interval(1, "compile", 12.0, 15.0, programs={"a": 1}), interval(1, "compile", 14.0, 18.0, programs={"b": 1}),
        {"event": "attempt_end", "attempt": 1, "time": 20.0, "how": "stopped"},
    ]
    r = goodput.report(records)
    assert r.seconds["compile"] == 6.0  # the union of overlapping spans, counted once
    assert r.seconds["eval"] == 4.0


def test_train_calls_recorded_without_their_start_still_report():
    """events.jsonl of the first release: a call's span was its end less its seconds."""
    old = {k: v for k, v in call(1, 0, 2, 4.0, 14.0).items() if k != "start"}
    records = [start(1, 0.0), interval(1, "startup", 0.0, 10.0), old, interval(1, "compile", 9.0, 11.0),
               {"event": "attempt_end", "attempt": 1, "time": 14.0, "how": "finished"}]
    r = goodput.report(records)
    assert (r.seconds["train"], r.seconds["startup"], r.seconds["compile"], r.unaccounted) == (3.0, 9.0, 2.0, 0.0)


def test_an_attempt_starts_when_its_process_did():
    """Its imports count: the start is read from the kernel's record of the process (a wrong field of
    /proc/self/stat would be years or a boot's age off), before the first line of Python ran."""
    code = "import time; t = time.time()\nfrom trainer.telemetry.timeline import process_start_time\nprint(t - process_start_time())"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert 0 <= float(r.stdout) < 2, r.stdout + r.stderr


def test_a_train_call_less_its_pre_save_probe_and_compilations_partitions_its_span():
    """The probe before a save (checkpoint work) sits inside a call's span, and may compile: every second of the
    span is counted once, as training, checkpoint or compile time."""
    records = [
        start(1, 0.0), {**call(1, 0, 2, 8.0, 10.0), "start": 0.0, "excluded": [8.0, 10.0]},
        interval(1, "compile", 7.0, 9.0, programs={"probe": 1}), interval(1, "checkpoint", 8.0, 10.0),
        {"event": "attempt_end", "attempt": 1, "time": 10.0, "how": "finished"},
    ]
    r = goodput.report(records)
    assert (r.seconds["train"], r.seconds["compile"], r.seconds["checkpoint"]) == (7.0, 2.0, 1.0)
    assert r.unaccounted == 0.0


def test_the_report_cli_reads_a_run_directory(tmp_path, capsys):
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        start(1, 0.0), call(1, 0, 2, 5.0, 10.0), {"event": "attempt_end", "attempt": 1, "time": 10.0,
                                                   "how": "finished"}]))
    assert goodput_cli.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("goodput  50.0% of 0m10.0s wall time over 1 attempt(s) (1: finished)")
    with pytest.raises(SystemExit):
        goodput_cli.main([str(tmp_path / "missing")])
    assert "no events.jsonl" in capsys.readouterr().err


def test_a_start_reads_events_jsonl_once_and_drops_a_torn_last_line(tmp_path, monkeypatch, capsys):
    """The attempt's number and the torn-line repair come from one read of the file."""
    from trainer.storage.run_dir import RunDir
    from trainer.telemetry.timeline import open_timeline

    events = tmp_path / "events.jsonl"
    events.write_text('{"event": "attempt_start", "attempt": 1, "time": 1.0}\n{"event": "interv')
    reads, load = [], RunDir._load_jsonl
    counted = staticmethod(lambda path, **kw: reads.append(path.name) or load(path, **kw))
    monkeypatch.setattr(RunDir, "_load_jsonl", counted)
    timeline = open_timeline(RunDir(tmp_path), 2.0, 3.0)
    timeline.commit()
    timeline.end("finished")
    assert reads == ["events.jsonl"]
    records = read_jsonl(events)
    assert records[0] == {"event": "attempt_start", "attempt": 1, "time": 1.0}
    assert [r["attempt"] for r in records[1:]] == [2] * (len(records) - 1) and records[-1]["how"] == "finished"
    assert capsys.readouterr().err == (f"warning: {events}: dropped a torn last line (a kill or a full disk during"
                                       " its write)\n")
