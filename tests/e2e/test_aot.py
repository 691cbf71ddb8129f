"""Ahead-of-time compilation of the real train call for TPU topologies (libtpu, no TPU needed), as a user meets it.

The suite's one compile of a real preset: gpt2_124m on v5e:2x4 (its widths, batch, micro-batches, mesh, splash
attention and flags; two of its twelve layers, which it unrolls: copies of one block, whose kernels and cross-layer
schedule two layers show in a sixth of the compile), by `plan.py` run as a user runs it (no JAX_PLATFORMS, libtpu
installed) into a store of its own, which this process then reads back for the step-time model's checks. Everything
else compiles a tiny model. The report's lines with known figures, in-process:
tests/unit/test_aot.py; libtpu's environment: tests/unit/test_libtpu_env.py."""

import dataclasses
import functools
import os
import subprocess
import sys

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another process may hold libtpu's lock file

import pytest  # noqa: E402

import configs  # noqa: E402
import plan as plan_app  # noqa: E402
from support.cli import ROOT, SMALL, last_line, run_main  # noqa: E402

pytest.importorskip("libtpu", reason="the `tpu` extra brings libtpu")

LIBTPU_NOISE = ("E0000", "INVALID_ARGUMENT", "Source Location Trace", "Failed to find host bounds")


def run_as_a_user(script: str, *args: str, home=None) -> subprocess.CompletedProcess:
    """`python script args` as a user runs it on a machine without a TPU: JAX picks its platform itself (no
    JAX_PLATFORMS) and finds libtpu installed; libtpu's environment is only what the script sets. XLA_FLAGS are
    this process's, so that a compile it stores (under `home`) is the one this process would make."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "LIBTPU_INIT_ARGS", "TPU_WORKER_HOSTNAMES", "TPU_HOST_BOUNDS")}
    env.update(ALLOW_MULTIPLE_LIBTPU_LOAD="1", **({"HOME": str(home)} if home else {}))
    return subprocess.run([sys.executable, str(ROOT / script), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)


def libtpu_noise(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if any(mark in line for mark in LIBTPU_NOISE)]


LAYERS = 2  # of gpt2_124m's 12


@pytest.fixture(scope="module")
def gpt2_124m(tmp_path_factory):
    """(plan.py's run for gpt2_124m on v5e:2x4, the store it compiled into)."""
    home = tmp_path_factory.mktemp("home")
    r = run_as_a_user("plan.py", "--config", "gpt2_124m", "--topology", "v5e:2x4", f"--model.n_layer={LAYERS}",
                      home=home)
    return r, home / ".cache" / "gpt2_nnx" / "aot"


def test_plan_py_says_what_it_compiles_then_answers_first_and_prints_no_libtpu_lines(gpt2_124m):
    r, _ = gpt2_124m
    assert r.returncode == 0, r.stderr[-3000:]
    assert not libtpu_noise(r.stderr), r.stderr[-3000:]
    out = r.stdout.splitlines()
    assert out[0].startswith("Compiling gpt2_124m's train call for v5e:2x4: 8 chips, mesh data 8 × fsdp 1 × tensor 1,"
                             " batch 512 × 1024 tokens (64 sequences per chip in 8 micro-batches), 10 steps per call,"
                             " with the libtpu flags train.py sets on v5e")
    assert out[1] == "gpt2_124m on v5e:2x4 (8 chips), predicted from the compiled program, not measured:"
    verdict = {line.split()[0]: line for line in out[2:7]}
    assert list(verdict) == ["fits", "step", "tokens/s", "MFU", "bottleneck"]
    used = float(verdict["fits"].split()[2])
    assert verdict["fits"].split()[1] == "yes," and 0.5 < used < 16.0  # GiB: params + AdamW state, at most the chip
    step = float(verdict["step"].split()[1])
    assert step > 0 and ("expect" in verdict["step"] or "no comparable measured run" in verdict["step"])
    tokens = float(verdict["tokens/s"].split()[1].replace(",", ""))
    assert tokens == pytest.approx(512 * 1024 / 8 / (step / 1e3), rel=2e-3)
    assert "(PaLM, nanoGPT)" in verdict["MFU"] and "(MaxText, llm.c)" in verdict["MFU"]
    assert out.index("Memory per chip:") > 7 and "XLA's cost analysis" not in r.stdout  # that is --verbose's
    bound = next(line for line in out if line.strip().startswith("lower bound"))
    assert 0 < float(bound.split()[2]) <= step  # ms per step, from the compiled program


def test_gpt2_124m_on_v5e_2x4_gets_an_estimate_its_fixed_costs_move_by_under_3_percent(gpt2_124m, monkeypatch):
    from planning import compile_store, step_time
    from planning.aot import compile_train_call
    from planning.chips import CHIPS

    monkeypatch.setattr(compile_store, "STORE", str(gpt2_124m[1]))
    cfg = configs.load("gpt2_124m")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layer=LAYERS))
    program, mesh = compile_train_call(cfg, "v5e:2x4")
    assert program.from_store  # plan.py's compile, not a second one
    t = cfg.train
    model_flops = cfg.model.flops_per_token(t.seq_len) * t.batch_size * t.seq_len / mesh.size
    estimate = functools.partial(step_time.estimate_hlo, program.hlo, CHIPS["v5e"], dict(mesh.shape),
                                 steps_per_call=t.steps_per_call, torus=step_time.torus(mesh),
                                 model_flops_per_step=model_flops)
    e, bare = estimate(), estimate(fixed_costs=False)
    assert bare.predicted_s <= e.predicted_s < 1.03 * bare.predicted_s
    assert e.lower_bound_s > 0 and e.unknown_loops == 0
    # 6N + attention vs the program's MXU FLOPs: splash attention's are inside its kernels, the padded vocabulary adds
    assert 0.7 * model_flops < e.flops < 1.5 * model_flops
    assert 0.05 < e.predicted_mfu <= e.mfu_bound < 1.0
    assert e.opaque_kernels == 0 and e.splash_kernels > 0  # splash's kernels are counted from their shapes
    assert any(c.kind == "all-reduce" and c.axis == "data" for c in e.collectives)  # the gradients
    # libtpu runs this call's all-reduces synchronously: every one is exposed, on top of the ops in series
    assert e.exposed_s == pytest.approx(e.collective_s)
    assert e.predicted_s == pytest.approx(max(e.roofline_s + e.fixed_s + e.collective_s, e.hbm_s))
    # plan.py printed this estimate
    assert f"step        {e.predicted_s * 1e3:.1f} ms;" in gpt2_124m[0].stdout


def test_training_and_evaluating_without_a_tpu_print_no_libtpu_lines(shakespeare, tmp_path):
    r = run_as_a_user("train.py", *SMALL, "--train.steps=2", f"--data.dataset={shakespeare}",
                      f"--run_dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert not libtpu_noise(r.stderr), r.stderr[-3000:]
    r = run_as_a_user("eval.py", f"--run_dir={tmp_path / 'run'}", "--batches=1", "--no-wandb")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "val_loss" in r.stdout + r.stderr and not libtpu_noise(r.stderr), r.stderr[-3000:]


TINY = ["--model.n_layer=1", "--model.n_head=2", "--model.n_embd=64", "--model.block_size=128",
        "--model.vocab_size=512", "--train.seq_len=128", "--train.batch_size=8", "--train.grad_accum=1",
        "--train.steps_per_call=1"]
# 1.6 B parameters and their Adam moments on every chip: 26 GiB of 16
BIG = ["--model.n_layer=8", "--model.n_embd=4096", "--model.n_head=32", "--model.scan_layers=true", "--mesh.rules=dp"]


def test_a_compile_is_kept_and_read_back_and_a_changed_program_compiles_again(tmp_path, monkeypatch):
    """The store of TPU compiles: the same lowered program and topology read back (same report, no compile), any
    change to the program or its flags compiled afresh; a refusal (does not fit) is kept as the compiler's message,
    which plan.py prints as one line with the compiler's numbers."""
    from configs.base import Config
    from configs.cli import parse
    from planning import aot, compile_store
    from trainer import libtpu_env

    monkeypatch.setattr(compile_store, "STORE", str(tmp_path))
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    compiles = []
    compile_once = compile_store._compile
    monkeypatch.setattr(compile_store, "_compile",
                        lambda lowered, options: compiles.append(options) or compile_once(lowered, options))

    def report(*flags):
        return aot.compile_for_topology(parse(Config, [*TINY, *flags], default=configs.load("gpt2_124m"),
                                              prog="test"), "v5e:2x2")

    first, again = report(), report()
    assert len(compiles) == 1 and not first.from_store and again.from_store
    assert compiles[0] == libtpu_env.COLLECTIVE_FLAGS["v5e"].flags  # the flags train.py sets on a v5e
    assert again.step_time == first.step_time and again.temp_bytes == first.temp_bytes
    code, out, err = run_main(plan_app.main, "--config", "gpt2_124m", "--topology", "v5e:2x2", *TINY, "--verbose")
    assert code == 0 and len(compiles) == 1, err[-3000:]  # plan.py reads the same compile back
    assert "(read back from" in out.splitlines()[1] and "XLA's cost analysis" in out and "libtpu's cost model" in out
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_enable_async_collective_fusion=true")  # the user's own
    report()
    assert len(compiles) == 2 and compiles[1] == {}  # theirs apply (read by libtpu), ours are not added
    monkeypatch.delenv("LIBTPU_INIT_ARGS")
    report("--model.remat=full")
    assert len(compiles) == 3
    with pytest.raises(aot.DoesNotFit, match="does not fit in HBM"):
        report(*BIG)
    code, out, err = run_main(plan_app.main, "--config", "gpt2_124m", "--topology", "v5e:2x2", *TINY, *BIG)
    assert len(compiles) == 4  # the refusal read back
    assert code == 2 and out.startswith("Compiling gpt2_124m's train call for v5e:2x2: 4 chips")
    assert last_line(err).startswith("error: --topology v5e:2x2: does not fit in HBM")
    assert "G)" in last_line(err) and "15.75G" in last_line(err)  # the compiler's required vs available bytes

