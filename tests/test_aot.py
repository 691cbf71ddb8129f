"""Ahead-of-time compilation of the real train call for TPU topologies (libtpu, no TPU needed)."""

import pytest

from conftest import run_cli

pytest.importorskip("libtpu", reason="the `tpu` extra brings libtpu")
pytestmark = pytest.mark.slow
# another process (tests/test_step_time.py in a parallel worker) may hold libtpu's lock file; compiling needs no TPU
LIBTPU = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def test_gpt2_124m_compiles_and_fits_on_v5e_2x2():
    r = run_cli("train.py", "--config", "gpt2_124m", "--aot", "v5e:2x2", "--train.grad_accum=32",
                "--train.steps_per_call=2", devices=1, env=LIBTPU)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "AOT compile for v5e:2x2 (4 devices), per device:" in out
    assert "fits in HBM" in out and "DOES NOT FIT" not in out
    total = next(line for line in out.splitlines() if line.strip().startswith("total"))
    used = float(total.split()[1])
    assert 0.5 < used < 16.0  # GiB: at least the replicated params + AdamW state, at most the chip
    bound = next(line for line in out.splitlines() if line.strip().startswith("lower bound"))
    assert float(bound.split()[2]) > 0 and "MFU <=" in bound  # ms per step, from the compiled program
    predicted = next(line for line in out.splitlines() if "op by op + exposed collectives" in line)
    assert float(predicted.split()[1]) >= float(bound.split()[2])
    assert "predicted MFU" in predicted and "bottleneck:" in predicted


def test_an_oversized_model_is_reported_as_not_fitting_with_numbers():
    r = run_cli("train.py", "--config", "gpt2_124m", "--aot", "v5e:2x2", "--model.n_layer=48",
                "--model.n_embd=1600", "--model.n_head=25", "--mesh.rules=dp", devices=1, env=LIBTPU)
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --aot v5e:2x2: does not fit in HBM")
    assert "G)" in last and "15.75G" in last  # the compiler's required vs available bytes


def test_unknown_tpu_generation_is_one_line():
    r = run_cli("train.py", "--config", "gpt2_124m", "--aot", "v9x:2x2", devices=1)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == "error: --aot v9x:2x2: unknown TPU generation 'v9x'; known: ['v4', 'v5e', 'v5p', 'v6e']"
