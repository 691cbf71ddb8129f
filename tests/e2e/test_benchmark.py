"""The performance benchmark run end to end on a tiny budget (nothing timed); its figures: tests/unit."""

import json

import pytest

from benchmarks import train_step as bench
from gpt2 import GPT2Config

FLOPS_PER_TOKEN = GPT2Config(n_layer=4, n_head=4, n_embd=128, block_size=64).flops_per_token(64)


def test_the_benchmark_runs_end_to_end_on_a_tiny_budget(tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench.main(["--k", "1", "2", "--repeats", "1", "--skip", "torch", "compile", "loader", "--json", str(out)])
    r = json.loads(out.read_text())
    for k in (1, 2):
        ours = r[f"ours_k{k}"]
        assert ours["tokens_per_s"] > 0 and ours["first_call_s"] > 0
        assert ours["tokens_per_s"] * ours["median_s"] == pytest.approx(k * 12 * 64)  # K·B·T tokens a call
    assert 0 < r["checkpoint"]["blocked_s"] <= r["checkpoint"]["save_s"]
    assert "ours, K=2" in capsys.readouterr().out
