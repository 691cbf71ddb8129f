"""Ahead-of-time compilation of the real train call for TPU topologies (libtpu, no TPU needed)."""

import dataclasses
import subprocess
import sys

import pytest
from conftest import ROOT, SMALL, cli_env, run_cli

pytest.importorskip("libtpu", reason="the `tpu` extra brings libtpu")
# another process (tests/test_step_time.py in a parallel worker) may hold libtpu's lock file; compiling needs no TPU
LIBTPU = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


LIBTPU_NOISE = ("E0000", "INVALID_ARGUMENT", "Source Location Trace", "Failed to find host bounds")


def run_as_a_user(*args: str) -> subprocess.CompletedProcess:
    """`python train.py args` as a user runs it on a machine without a TPU: JAX picks its platform itself (no
    JAX_PLATFORMS) and finds libtpu installed; libtpu's environment is only what train.py sets."""
    env = {k: v for k, v in cli_env(1, LIBTPU).items()
           if k not in ("JAX_PLATFORMS", "LIBTPU_INIT_ARGS", "TPU_WORKER_HOSTNAMES", "TPU_HOST_BOUNDS")}
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def no_libtpu_noise(stderr: str) -> bool:
    return not [line for line in stderr.splitlines() if any(mark in line for mark in LIBTPU_NOISE)]


@pytest.mark.slow
def test_training_without_a_tpu_prints_no_libtpu_lines(shakespeare, tmp_path):
    r = run_as_a_user(*SMALL, "--train.steps=2", f"--data.dataset={shakespeare}", f"--run_dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert no_libtpu_noise(r.stderr), r.stderr[-3000:]


@pytest.mark.slow
def test_gpt2_124m_compiles_and_fits_on_v5e_2x2():
    """What --aot prints, in order: what it compiles for what, then the verdict, then the breakdown; and no libtpu
    start-up lines although it loads libtpu to compile."""
    r = run_as_a_user("--config", "gpt2_124m", "--aot", "v5e:2x2", "--train.grad_accum=32",
                      "--train.steps_per_call=2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert no_libtpu_noise(r.stderr), r.stderr[-3000:]
    out = r.stdout.splitlines()
    assert out[0].startswith("Compiling gpt2_124m's train call for v5e:2x2: 4 chips, mesh data 4 × fsdp 1 × tensor 1,"
                             " batch 512 × 1024 tokens (128 sequences per chip in 32 micro-batches), 2 steps per call,"
                             " with the libtpu flags train.py sets on v5e")
    assert out[1].startswith("gpt2_124m on v5e:2x2 (4 chips), predicted from the compiled program, not measured")
    verdict = {line.split()[0]: line for line in out[2:7]}
    assert list(verdict) == ["fits", "step", "tokens/s", "MFU", "bottleneck"]
    used = float(verdict["fits"].split()[2])
    assert verdict["fits"].split()[1] == "yes," and 0.5 < used < 16.0  # GiB: params + AdamW state, at most the chip
    step = float(verdict["step"].split()[1])
    assert step > 0 and ("expect" in verdict["step"] or "no comparable measured run" in verdict["step"])
    assert float(verdict["tokens/s"].split()[1].replace(",", "")) == pytest.approx(512 * 1024 / 4 / (step / 1e3),
                                                                                    rel=2e-3)
    assert "(PaLM, nanoGPT)" in verdict["MFU"] and "(MaxText, llm.c)" in verdict["MFU"]
    assert out.index("Memory per chip:") > 7 and "XLA's cost analysis" not in r.stdout  # that is --verbose's
    bound = next(line for line in out if line.strip().startswith("lower bound"))
    assert 0 < float(bound.split()[2]) <= step  # ms per step, from the compiled program


@pytest.mark.slow
def test_an_oversized_model_is_reported_as_not_fitting_with_numbers():
    r = run_cli("train.py", "--config", "gpt2_124m", "--aot", "v5e:2x2", "--model.n_layer=48",
                "--model.n_embd=1600", "--model.n_head=25", "--mesh.rules=dp", devices=1, env=LIBTPU)
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --aot v5e:2x2: does not fit in HBM")
    assert "G)" in last and "15.75G" in last  # the compiler's required vs available bytes


@pytest.mark.slow
def test_unknown_tpu_generation_is_one_line():
    r = run_cli("train.py", "--config", "gpt2_124m", "--aot", "v9x:2x2", devices=1)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == ("error: --aot v9x:2x2: unknown TPU generation 'v9x'; known:"
                                                 " ['v4', 'v5e', 'v5p', 'v6e']")


@pytest.mark.slow
def test_a_compile_is_kept_and_read_back_and_a_changed_program_compiles_again(tmp_path, monkeypatch):
    """The store of TPU compiles: the same lowered program and topology read back (same report, no compile), any
    change to the program compiled afresh; a refusal (does not fit) is kept as the compiler's message."""
    import configs
    from configs.base import Config
    from configs.cli import parse
    from trainer.perf import aot, compile_store, libtpu_env

    monkeypatch.setattr(compile_store, "STORE", str(tmp_path))
    compiles = []
    compile_once = compile_store._compile
    monkeypatch.setattr(compile_store, "_compile",
                        lambda lowered, options: compiles.append(options) or compile_once(lowered, options))
    tiny = ["--model.n_layer=1", "--model.n_head=2", "--model.n_embd=128", "--model.block_size=128",
            "--model.vocab_size=512", "--train.seq_len=128", "--train.batch_size=8", "--train.grad_accum=1",
            "--train.steps_per_call=1"]

    def report(*flags):
        return aot.compile_for_topology(parse(Config, [*tiny, *flags], default=configs.load("gpt2_124m"),
                                              prog="test"), "v5e:2x2")

    first, again = report(), report()
    assert len(compiles) == 1 and not first.from_store and again.from_store
    assert compiles[0] == libtpu_env.COLLECTIVE_FLAGS["v5e"].flags  # the flags train.py sets on a v5e
    assert again.step_time == first.step_time and again.temp_bytes == first.temp_bytes
    assert "read back from" in again.text().splitlines()[0]
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_enable_async_collective_fusion=true")  # the user's own
    report()
    assert len(compiles) == 2 and compiles[1] == {}  # theirs apply (read by libtpu), ours are not added
    monkeypatch.delenv("LIBTPU_INIT_ARGS")
    report("--model.remat=full")
    assert len(compiles) == 3
    big = ["--model.n_layer=8", "--model.n_embd=4096", "--model.n_head=32", "--model.scan_layers=true",
           "--mesh.rules=dp"]  # 1.6 B parameters and their Adam moments on every chip: 26 GiB of 16
    for _ in range(2):
        with pytest.raises(aot.DoesNotFit, match="does not fit in HBM"):
            report(*big)
    assert len(compiles) == 4


# ---- libtpu's environment (trainer/perf/libtpu_env.py) ---------------------------------------------------------

def test_on_a_tpu_the_generations_flags_are_set_unless_the_user_set_their_own(monkeypatch):
    from jax._src import hardware_utils

    from trainer.perf import libtpu_env

    monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id",
                        lambda: (8, hardware_utils.TpuVersion.v5e))
    environ = {}
    libtpu_env.configure(environ)
    assert environ == {"LIBTPU_INIT_ARGS": libtpu_env.COLLECTIVE_FLAGS["v5e"].init_args()}
    assert "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true" in environ["LIBTPU_INIT_ARGS"]
    mine = {"LIBTPU_INIT_ARGS": "--xla_enable_async_all_gather=false"}
    libtpu_env.configure(mine)
    assert mine == {"LIBTPU_INIT_ARGS": "--xla_enable_async_all_gather=false"}


def test_without_a_tpu_libtpu_is_told_it_runs_on_one_host_of_its_own(monkeypatch):
    from jax._src import hardware_utils

    from trainer.perf import libtpu_env

    monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id", lambda: (0, None))
    environ = {"TPU_WORKER_HOSTNAMES": "10.0.0.2"}  # a user's value is kept
    libtpu_env.configure(environ)
    assert environ == {"TPU_WORKER_HOSTNAMES": "10.0.0.2", "TPU_HOST_BOUNDS": "1,1,1"}


@pytest.mark.parametrize("generation", ["v4", "v5e", "v5p", "v6e"])
def test_every_shipped_flag_is_one_the_installed_libtpu_knows(generation, monkeypatch):
    """A flag libtpu does not know fails the compile ("No such compile option"): each generation's flags compile a
    small sharded matmul for its topology."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from trainer.perf import libtpu_env
    from trainer.perf.aot import topology_devices

    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    topology = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}[generation]
    mesh = jax.make_mesh((4,), ("fsdp",), devices=topology_devices(topology), axis_types=(jax.sharding.AxisType.Auto,))
    x, w = (jax.ShapeDtypeStruct((512, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp"))) for _ in "xw")
    options = libtpu_env.compile_options(generation)
    assert options == libtpu_env.COLLECTIVE_FLAGS[generation].flags and options
    with jax.set_mesh(mesh):
        jax.jit(lambda x, w: x @ w.T).lower(x, w).compile(compiler_options=options)


def test_the_report_gives_the_verdict_first_and_keeps_the_compilers_own_figures_for_verbose():
    from trainer.hardware import CHIPS
    from trainer.perf.aot_report import AotReport
    from trainer.perf.step_report import StepTimeEstimate

    e = StepTimeEstimate(chip=CHIPS["v5e"], flops=1e13, hbm_bytes=1e10, compute_s=0.08, hbm_s=0.02, roofline_s=0.1,
                         collectives=(), model_flops=1.2e13, causal_model_flops=1.1e13, ops=1000, fixed_s=0.001)
    gib = 2**30
    r = AotReport(topology="v5e:2x4", devices=8, argument_bytes=gib, output_bytes=gib, temp_bytes=4 * gib,
                  alias_bytes=gib, hbm_bytes=16 * gib, flops_per_step=2e12, model_flops_per_step=1.2e13,
                  optimal_seconds=-5.0, steps_per_call=1, step_time=e, libtpu_vmem_step_s=0.2,
                  tokens_per_step=512 * 1024, preset="gpt2_124m")
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
    oversized = dataclasses.replace(r, temp_bytes=20 * gib)
    assert oversized.text().splitlines()[1] == ("  fits        NO: 21.00 GiB per chip, 5.00 GiB more than the chip's"
                                                " 16.00 GiB HBM")
