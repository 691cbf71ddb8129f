"""The programs a run needs after its first call (the evaluation's loss, the final sample's decoding) compile on the
background thread while the first calls train, where there are cores for it (more than 2: trainer/program/ahead.py
OVERLAP_COMPILES); their first use then compiles nothing on the main thread. On 2 cores they compile where first
needed (trainer/run/observers.py CompileAhead says why)."""

import pytest

import train as train_app
from support.cli import SMALL, read_jsonl, run_main
from trainer.run import observers


def compiled(run_dir, kind: str) -> tuple[dict, dict, dict]:
    """The programs the main thread compiled within the run's first `kind` interval (an evaluation, the sample),
    those it compiled in all, and those the background thread compiled."""
    records = read_jsonl(run_dir / "events.jsonl")
    during = next(r for r in records if r["event"] == "interval" and r["kind"] == kind)
    inside, main, ahead = {}, {}, {}
    for r in records:
        if r["event"] == "interval" and r["kind"] == "compile":
            if r.get("background"):
                ahead |= r["programs"]
                continue
            main |= r["programs"]
            if during["start"] <= r["start"] and r["end"] <= during["end"]:
                inside |= r["programs"]
    return inside, main, ahead


@pytest.mark.parametrize("overlap", [True, False])
def test_the_evaluation_and_the_sample_compile_ahead_only_where_there_are_cores(overlap, tmp_path, shakespeare,
                                                                              monkeypatch):
    monkeypatch.setattr(observers, "OVERLAP_COMPILES", overlap)
    run_dir = tmp_path / "run"
    code, out, err = run_main(train_app.main, "--run_dir", str(run_dir), f"--data.cache_dir={shakespeare}", *SMALL,
                              "--train.steps=4", "--train.eval_every=4", "--train.sample_tokens=4",
                              "--train.compile_cache=off")
    assert code == 0, err[-3000:]
    assert "--- sample ---" in out
    for kind, program in (("eval", "jit(<lambda>)"), ("sample", "jit(generate_cached)")):
        inside, main, ahead = compiled(run_dir, kind)
        if overlap:  # (the sample's key is still made on the main thread: two tiny programs)
            assert program in ahead and program not in inside, (kind, inside, ahead)
        else:  # the loss is first needed by the pre-save probe, at the first checkpoint
            assert program in main and program not in ahead, (kind, main, ahead)
