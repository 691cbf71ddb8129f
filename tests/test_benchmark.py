"""The performance benchmark (issue 6) runs end to end and its figures hang together. Nothing here is timed."""

import json
import os
import subprocess
import sys

from conftest import ROOT
from gpt2 import GPT2Config


def test_benchmark_measures_ours_torch_peaks_and_checkpoint_in_one_run(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}  # the whole CPU as one device, as users run it
    proc = subprocess.run([sys.executable, "-m", "benchmarks.train_step", "--k", "1", "2", "--repeats", "2",
                           "--skip", "compile", "loader", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert "ratio ours k2 vs transformers" in proc.stdout and "ceiling at XLA's float32 peak" in proc.stdout

    model = GPT2Config(n_layer=4, n_head=4, n_embd=128, block_size=64)
    flops_per_token = model.flops_per_token(64)
    assert r["keep_freed_memory"] is True
    for key in ("peak_flops_f32", "peak_flops_bf16", "torch_peak_flops_f32", "torch_peak_flops_bf16"):
        assert 1e8 < r[key] < 1e14, (key, r[key])  # a real measurement on some CPU, not a default
    assert abs(r["ceiling_tokens_per_s"] * flops_per_token / r["peak_flops_f32"] - 1) < 1e-9
    for k in (1, 2):
        ours = r[f"ours_k{k}"]
        assert ours["min_s"] <= ours["median_s"] <= ours["max_s"]
        assert abs(ours["tokens_per_s"] * ours["median_s"] / (k * 12 * 64) - 1) < 1e-9  # K·B·T tokens a call
        assert abs(ours["mfu_vs_f32_peak"] - ours["tokens_per_s"] * flops_per_token / r["peak_flops_f32"]) < 1e-9
        assert ours["first_call_s"] > ours["median_s"]  # the first call compiles and is excluded
        assert abs(r[f"ratio_ours_k{k}_vs_transformers"] * r["transformers"]["tokens_per_s"]
                   - ours["tokens_per_s"]) < 1e-6
    assert abs(r["ratio_k2_vs_k1"] * r["ours_k1"]["tokens_per_s"] - r["ours_k2"]["tokens_per_s"]) < 1e-6
    c = r["checkpoint"]
    assert 0 < c["blocked_s"] <= c["save_s"] and abs(c["blocked_fraction"] - c["blocked_s"] / c["save_s"]) < 1e-9
