"""A long run stays flat: benchmarks/soak.py's arithmetic on hand-made samples, and the bounded loss curve.
(The soak itself is a script: docs/performance.md has its command and figures.)"""

import json

from benchmarks import soak
from trainer.telemetry.metrics import LossCurve


def test_rss_samples_are_placed_at_the_step_reached_and_startup_and_shutdown_left_out(tmp_path):
    events = tmp_path / "events.jsonl"
    events.write_text("".join(json.dumps(r) + "\n" for r in [
        {"event": "attempt_start", "time": 0.0},
        {"event": "train_call", "first": 0, "steps": 10, "start": 1.0, "end": 10.0},
        {"event": "interval", "kind": "eval", "start": 10.0, "end": 12.0},
        {"event": "train_call", "first": 10, "steps": 10, "start": 12.0, "end": 20.0},
        {"event": "train_call", "first": 20, "steps": 5, "start": 20.0, "end": 30.0},
    ]))
    reached = soak.steps_reached(events)
    assert reached == [(10.0, 10), (20.0, 20), (30.0, 25)]
    samples = [(5.0, 100), (11.0, 200), (25.0, 300), (29.0, 0), (35.0, 900)]  # 0: a failed read
    assert soak.at_steps(samples, reached) == [(10, 200.0), (20, 300.0)]  # start-up (5 s), shutdown (35 s) out


def test_the_windows_are_medians_after_the_warmup_and_at_the_end():
    values = [(s, 100.0 + (s > 900) * 10 + (s == 950) * 1000) for s in range(1, 1001)]
    assert soak.windows(values, warmup=500, window=0.1) == (100.0, 110.0)  # one outlier moves no median
    assert soak.windows(values[:300], warmup=500, window=0.1) == (100.0, 100.0)  # short run: after half of it
    calls = [(10, 1.0), (20, 2.0), (30, 3.0)]  # a few calls: each window holds one at least
    assert soak.windows(calls, warmup=10, window=0.1) == (2.0, 3.0)


def test_a_step_takes_its_calls_tokens_over_its_rate(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 0, "tokens": 0, "tokens_per_s": null}\n{"step": 1, "tokens": 1024, "tokens_per_s": 512.0}\n{"step": 1, "val_loss": 5.0}\n'
                       '{"step": 2, "tokens": 2048, "tokens_per_s": 2048.0}\n')
    assert soak.step_times(metrics) == [(1, 2.0), (2, 0.5)]


def test_the_loss_curve_keeps_a_bounded_evenly_spaced_sample(monkeypatch):
    monkeypatch.setattr(LossCurve, "MAX_POINTS", 4)
    curve = LossCurve({"step": s, "loss": float(s)} for s in range(1, 11))
    assert curve.points["train"] == [(1, 1.0), (5, 5.0), (9, 9.0)]  # every 4th once full twice
    curve.add({"step": 10, "val_loss": 2.5})
    curve.add({"step": 11, "loss": None})  # a step the spike guard skipped: not drawn
    assert curve.points == {"train": [(1, 1.0), (5, 5.0), (9, 9.0)], "val": [(10, 2.5)]}
