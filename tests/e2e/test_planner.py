"""A real plan through plan.py's main: a tiny model searched on one chip (v5e:1x1, a v5litepod-1) with a budget that
stops after the preset's compile (one compile), what it will do first, then its verdict and the table. The search
itself: tests/unit/test_planner.py."""

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another process may hold libtpu's lock file

import pytest  # noqa: E402

import plan as plan_app  # noqa: E402
from support.cli import run_main  # noqa: E402

pytest.importorskip("libtpu", reason="the `tpu` extra brings libtpu")

TINY = ["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=64", "--model.block_size=128",
        "--model.pad_vocab_to=128", "--model.vocab_size=512", "--train.seq_len=128", "--train.batch_size=16",
        "--train.grad_accum=2", "--mesh.data=-1", "--mesh.rules=dp"]


def test_a_real_plan_of_a_tiny_model_answers_with_its_verdict_first(tmp_path, monkeypatch):
    from planning import compile_store

    monkeypatch.setattr(compile_store, "STORE", str(tmp_path))  # a compile now, not one kept from another run
    code, out, err = run_main(plan_app.main, "--config", "gpt2_124m", "--topology", "v5e:1x1", "--search",
                              "--budget", "1e-9", *TINY)  # the preset only
    assert code == 0, err[-3000:]
    out = out.splitlines()
    assert out[0].startswith("Planning --config gpt2_124m for v5e:1x1 (1 chip): a coordinate descent from the preset")
    assert "--budget stops it starting compiles after 1e-09 s, so it ends in under a minute." in out[0]
    assert out[1] == "Best for --config gpt2_124m on v5e:1x1, predicted from its compiled program, not measured:"
    verdict = {line.split()[0]: line for line in out[2:8]}
    assert list(verdict) == ["flags", "fits", "step", "tokens/s", "MFU", "bottleneck"]
    assert verdict["flags"] == "  flags       (the preset as it is)" and verdict["fits"].split()[1] == "yes,"
    step_ms = float(verdict["step"].split()[1])
    mfu = float(verdict["MFU"].split()[1].rstrip("%"))
    assert step_ms > 0 and 0 < mfu < 100
    tokens = float(verdict["tokens/s"].split()[1].replace(",", ""))
    # the step printed to 0.1 ms: the tokens per chip over the step, within that rounding
    assert 16 * 128 / ((step_ms + 0.05) / 1e3) <= tokens <= 16 * 128 / (max(step_ms - 0.05, 1e-9) / 1e3)
    assert any(line.startswith("1 candidate compiled in") and "stopped at the budget" in line for line in out)
