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


def test_the_gpu_benchmark_plans_every_batch_with_nanogpts_shape_first_and_one_row_per_flag_set():
    from benchmarks import gpu_vs_nanogpt as gpu

    args = gpu.parse(["--nanogpt", "nanoGPT", "--batch", "64", "12", "--attention", "cudnn",
                      "--xla-flags=--xla_gpu_enable_cublaslt=true", "--xla-flags=--a=1 --b=2"])
    rows = [(name, batch, flags) for _, name, batch, flags in gpu.plan_rows(args)]
    cublaslt, two = "--xla_gpu_enable_cublaslt=true", "--a=1 --b=2"
    assert rows == [("cudnn", 12, None), ("nanogpt", 12, None), ("cudnn", 12, cublaslt), ("cudnn", 12, two),
                    ("cudnn", 64, None), ("nanogpt", 64, None), ("cudnn", 64, cublaslt), ("cudnn", 64, two)]


@pytest.mark.parametrize("kernel, kind", [
    ("nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT", "matmuls"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_cga1x1x1_kernel0_0",
     "attention (cuDNN)"),
    ("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*)", "attention (cuDNN)"),
    ("gemm_fusion_dot_3", "matmuls"), ("input_add_reduce_fusion_1", "XLA fusions"),
    ("wrapped_convert_5", "XLA fusions"),
    ("memset32", "other (copies, memsets)"),
])
def test_the_gpu_profile_sorts_kernels_of_a_recorded_h200_trace_by_kind(kernel, kind):
    """Names as they appear in the H200 trace of docs/performance.md; gemm_fusion_*: XLA's Triton GEMM fusions."""
    from benchmarks.gpu_vs_nanogpt import kernel_kind

    assert kernel_kind(kernel) == kind
