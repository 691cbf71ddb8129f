"""Ahead-of-time compilation of the real train call for TPU topologies (libtpu, no TPU needed)."""

import pytest

from support.cli import run_cli

pytest.importorskip("libtpu", reason="the `tpu` extra brings libtpu")
pytestmark = pytest.mark.slow
# another process (tests/test_step_time.py in a parallel worker) may hold libtpu's lock file; compiling needs no TPU
LIBTPU = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def test_gpt2_124m_compiles_and_fits_on_v5e_2x2():
    r = run_cli("plan.py", "--config", "gpt2_124m", "--topology", "v5e:2x2", "--train.grad_accum=32",
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
    r = run_cli("plan.py", "--config", "gpt2_124m", "--topology", "v5e:2x2", "--model.n_layer=48",
                "--model.n_embd=1600", "--model.n_head=25", "--mesh.rules=dp", devices=1, env=LIBTPU)
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --topology v5e:2x2: does not fit in HBM")
    assert "G)" in last and "15.75G" in last  # the compiler's required vs available bytes


def test_unknown_tpu_generation_is_one_line():
    r = run_cli("plan.py", "--config", "gpt2_124m", "--topology", "v9x:2x2", devices=1)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == "error: --topology v9x:2x2: unknown TPU generation 'v9x'; known: ['v4', 'v5e', 'v5p', 'v6e']"


def test_a_compile_is_kept_and_read_back_and_a_changed_program_compiles_again(tmp_path, monkeypatch):
    """The store of TPU compiles: the same lowered program and topology read back (same report, no compile), any
    change to the program compiled afresh; a refusal (does not fit) is kept as the compiler's message."""
    import configs
    from configs.base import Config
    from configs.cli import parse
    from planning import aot, compile_store

    monkeypatch.setattr(compile_store, "STORE", str(tmp_path))
    compiles = []
    compile_once = compile_store._compile
    monkeypatch.setattr(compile_store, "_compile", lambda lowered: compiles.append(1) or compile_once(lowered))
    tiny = ["--model.n_layer=1", "--model.n_head=2", "--model.n_embd=128", "--model.block_size=128",
            "--model.vocab_size=512", "--train.seq_len=128", "--train.batch_size=8", "--train.grad_accum=1",
            "--train.steps_per_call=1"]

    def report(*flags):
        return aot.compile_for_topology(parse(Config, [*tiny, *flags], default=configs.load("gpt2_124m"),
                                              prog="test"), "v5e:2x2")

    first, again = report(), report()
    assert len(compiles) == 1 and not first.from_store and again.from_store
    assert again.step_time == first.step_time and again.temp_bytes == first.temp_bytes
    assert "read back from" in again.text().splitlines()[0]
    report("--model.remat=full")
    assert len(compiles) == 2
    big = ["--model.n_layer=8", "--model.n_embd=4096", "--model.n_head=32", "--model.scan_layers=true",
           "--mesh.rules=dp"]  # 1.6 B parameters and their Adam moments on every chip: 26 GiB of 16
    for _ in range(2):
        with pytest.raises(aot.DoesNotFit, match="does not fit in HBM"):
            report(*big)
    assert len(compiles) == 3
