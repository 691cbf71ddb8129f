"""The performance benchmark's derived figures, on a synthetic result (nothing timed). Its tiny real run: tests/e2e."""


import pytest

from benchmarks import train_step as bench
from gpt2 import GPT2Config

FLOPS_PER_TOKEN = GPT2Config(n_layer=4, n_head=4, n_embd=128, block_size=64).flops_per_token(64)


def synthetic() -> dict:
    return {
        "peak_flops_f32": 100e9, "peak_flops_bf16": 150e9, "torch_peak_flops_f32": 200e9,
        "torch_peak_flops_bf16": 700e9,
        "ours_k1": {"tokens_per_s": 1000.0, "median_s": 0.768, "min_s": 0.7, "max_s": 0.8, "first_call_s": 5.0},
        "ours_k16": {"tokens_per_s": 1500.0, "median_s": 8.192, "min_s": 8.0, "max_s": 9.0, "first_call_s": 9.0},
        "transformers": {"tokens_per_s": 2000.0, "median_s": 0.384, "min_s": 0.3, "max_s": 0.4, "torch_threads": 2},
        "compile_s": {"scan": 6.0, "loop": 5.0, "gpt2_scan": 4.0, "gpt2_xl_scan": 5.0},
        "loader_tokens_per_s": 8e6,
        "checkpoint": {"blocked_s": 0.03, "save_s": 0.25, "blocked_fraction": 0.12},
    }


def test_derived_figures_are_the_ratios_of_the_measurements(capsys):
    r = bench.derive(synthetic(), FLOPS_PER_TOKEN, [1, 16])
    assert r["ceiling_tokens_per_s"] == pytest.approx(100e9 / FLOPS_PER_TOKEN)
    assert r["ours_k16"]["mfu_vs_f32_peak"] == pytest.approx(1500 * FLOPS_PER_TOKEN / 100e9)
    assert r["transformers"]["mfu_vs_torch_f32_peak"] == pytest.approx(2000 * FLOPS_PER_TOKEN / 200e9)
    assert r["ratio_ours_k1_vs_transformers"] == pytest.approx(0.5)
    assert r["ratio_ours_k16_vs_transformers"] == pytest.approx(0.75)
    assert r["ratio_k16_vs_k1"] == pytest.approx(1.5)
    assert r["ratio_ceiling_vs_transformers"] == pytest.approx(100e9 / FLOPS_PER_TOKEN / 2000)
    assert r["compile_s"]["xl_vs_gpt2"] == pytest.approx(1.25)
    bench.print_table(r)
    table = capsys.readouterr().out
    assert "ratio ours k16 vs transformers  0.75x" in table and "blocks 30 ms of 250 ms (12%)" in table
