"""What `plan.py --topology T` prints, in-process: the line before the compile (what is compiled for what, with
which flags, how long it may take), the verdict first and the compiler's own figures only with --verbose, and a
bad topology as one line before any compile. The real compiles: tests/e2e/test_aot.py."""

import dataclasses

import pytest

import plan as plan_app
from planning.aot_report import AotReport, compile_line
from planning.chips import CHIPS
from planning.step_report import StepTimeEstimate
from support.cli import last_line, run_main

GiB = 2**30


def test_the_first_line_says_what_is_compiled_for_what_and_how_long_it_may_take(monkeypatch):
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    line = compile_line("gpt2_124m", "v5e:2x2", {"data": 4, "fsdp": 1, "tensor": 1}, 512, 1024, 32, 2,
                        (150.0, "a fit to compiles on a 2-core machine"))
    assert line == ("Compiling gpt2_124m's train call for v5e:2x2: 4 chips, mesh data 4 × fsdp 1 × tensor 1,"
                    " batch 512 × 1024 tokens (128 sequences per chip in 32 micro-batches), 2 steps per call,"
                    " with the libtpu flags train.py sets on v5e (trainer/libtpu_env.py). The compile should take about"
                    " 2.5 min here (a fit to compiles on a 2-core machine); ~/.cache/gpt2_nnx/aot keeps the result,"
                    " so a re-run answers in seconds.")
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_enable_async_all_gather=true")
    line = compile_line("x", "v6e:1x1", {"data": 1}, 8, 128, 1, 1)  # stored: no estimate
    assert ": 1 chip, mesh data 1," in line and "with LIBTPU_INIT_ARGS as set. Compiled before:" in line


def report(**changes) -> AotReport:
    e = StepTimeEstimate(chip=CHIPS["v5e"], flops=1e13, hbm_bytes=1e10, compute_s=0.08, hbm_s=0.02, roofline_s=0.1,
                         collectives=(), model_flops=1.2e13, causal_model_flops=1.1e13, ops=1000, fixed_s=0.001)
    r = AotReport(topology="v5e:2x4", devices=8, argument_bytes=GiB, output_bytes=GiB, temp_bytes=4 * GiB,
                  alias_bytes=GiB, hbm_bytes=16 * GiB, flops_per_step=2e12, model_flops_per_step=1.2e13,
                  optimal_seconds=-5.0, steps_per_call=1, step_time=e, libtpu_vmem_step_s=0.2,
                  tokens_per_step=512 * 1024, preset="gpt2_124m")
    return dataclasses.replace(r, **changes)


def test_the_report_gives_the_verdict_first_and_keeps_the_compilers_own_figures_for_verbose():
    r = report()
    lines = r.text().splitlines()
    assert lines[0] == "gpt2_124m on v5e:2x4 (8 chips), predicted from the compiled program, not measured:"
    assert lines[1] == "  fits        yes, 5.00 of 16.00 GiB HBM per chip (11.00 GiB to spare)"
    assert lines[2].startswith("  step        101.0 ms; ")
    assert lines[3] == f"  tokens/s    {512 * 1024 / 8 / 0.101:,.0f} per chip, {512 * 1024 / 0.101:,.0f} on all 8 chips"
    assert lines[4].startswith("  MFU         60.3% counting 6N + attention over every query-key pair (PaLM, nanoGPT);"
                               " 55.3% counting the causal pairs only (MaxText, llm.c)")
    assert lines[5].startswith("  bottleneck  ") and lines[6] == "" and lines[7] == "Memory per chip:"
    assert "libtpu's own cost model charges VMEM at the HBM rate and prefetches in series: 200.0 ms" in r.text()
    assert "XLA's cost analysis" not in r.text() and "libtpu's cost model: -5" in r.text(verbose=True)
    oversized = report(temp_bytes=20 * GiB)
    assert oversized.text().splitlines()[1] == ("  fits        NO: 21.00 GiB per chip, 5.00 GiB more than the chip's"
                                                " 16.00 GiB HBM")


def test_no_line_is_cut_and_the_range_and_the_pessimistic_figure_tell_one_story():
    text = report().text(verbose=True)
    assert all(not line.rstrip().endswith((" as", " as libtpu cannot", ",")) for line in text.splitlines())
    assert "the pessimistic end" not in text  # libtpu's accounting is named as such, outside the range
    assert "The range above is for this accounting of on-chip memory" in text


@pytest.mark.parametrize("topology, message", [
    ("v9x:2x2", "--topology v9x:2x2: unknown TPU generation 'v9x'; known: ['v4', 'v5e', 'v5p', 'v6e']"),
    ("v5e:2x2*0", "--topology v5e:2x2*0: the number of slices after '*' must be a positive integer, got '0'"
                  " (e.g. v5e:16x16*2)"),
])
def test_a_bad_topology_is_one_line_before_any_compile(topology, message):
    code, out, err = run_main(plan_app.main, "--config", "gpt2_124m", "--topology", topology)
    assert code == 2 and last_line(err) == f"error: {message}" and out == "", err[-2000:]


@pytest.mark.parametrize("topology, chips, bounds", [
    ("v5e:1x1", 1, (1, 1, 1)), ("v6e:1x1", 1, (1, 1, 1)),  # v5litepod-1, v6e-1: one chip, one host
    ("v5e:1x2", 2, (1, 2, 1)), ("v5e:2x1", 2, (2, 1, 1)), ("v5e:1x1*2", 2, (1, 1, 1)),
    ("v5e:2x2", 4, (2, 2, 1)), ("v5e:2x4", 8, (2, 2, 1)), ("v4:2x2x1", 4, (2, 2, 1)),  # as before: hosts of 4
])
def test_a_slice_smaller_than_a_host_is_described_as_one_host_of_its_own(topology, chips, bounds):
    """libtpu refuses host bounds that do not divide the slice (v6e:1x1 under 2x2x1 was "cannot describe this
    topology"); a description is all this needs of libtpu (milliseconds, nothing compiled)."""
    pytest.importorskip("libtpu", reason="the `tpu` extra brings libtpu")
    from planning.aot import host_bounds, parse_topology, topology_devices

    assert host_bounds(parse_topology(topology)[0], (2, 2, 1)) == bounds
    assert len(topology_devices(topology)) == chips


def test_the_compile_time_estimate_is_the_fit_until_this_machine_has_compiled_then_scaled_by_it(tmp_path, monkeypatch):
    from planning import compile_store, compile_time

    monkeypatch.setattr(compile_store, "STORE", str(tmp_path))
    reference = compile_time.reference_s(2_201_233, 8192)  # gpt2_124m on v5e:2x4: 149 s measured on 2 busy cores
    assert 149 / 1.5 < reference < 149 * 1.5
    assert compile_time.estimate(2_201_233, 8192) == (reference, "fitted to compiles on a 2-core machine")
    compile_time.record(495_520, 8192, 2 * compile_time.reference_s(495_520, 8192))  # this machine: half as fast
    with open(tmp_path / "compile_times.jsonl", "a") as f:
        f.write('{"size": 1, "tokens')  # a line cut short by a kill
    seconds, basis = compile_time.estimate(2_201_233, 8192)
    assert seconds == pytest.approx(2 * reference, rel=1e-3)
    assert basis == "a fit to compiles on a 2-core machine, scaled by this machine's last 1"
    assert [compile_time.minutes(s) for s in (30, 150, 780)] == ["under a minute", "about 2.5 min", "about 13 min"]
