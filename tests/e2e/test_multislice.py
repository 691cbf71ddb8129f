"""Multislice as compiled and run: a tiny train call compiled for two v5e slices (its gradient reduction crosses DCN),
and two "slices" of local processes training as one slice of as many devices. In-process checks:
tests/unit/test_multislice.py."""

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another process may hold libtpu's lock file

import subprocess  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import configs  # noqa: E402
import train as train_app  # noqa: E402
from planning.chips import CHIPS  # noqa: E402
from planning.collectives import DCN_STEP_S  # noqa: E402
from support.cli import ROOT, SMALL, run_main, step_losses  # noqa: E402

V5E = CHIPS["v5e"]


TINY = ["--model.n_layer=1", "--model.n_head=2", "--model.n_embd=128", "--model.block_size=128",
        "--model.vocab_size=512", "--train.seq_len=128", "--train.batch_size=16", "--train.grad_accum=1",
        "--train.steps_per_call=1", "--mesh.fsdp=2", "--mesh.rules=fsdp"]


def test_a_tiny_train_call_compiles_for_two_v5e_slices_and_its_gradient_reduction_crosses_dcn(tmp_path, monkeypatch):
    pytest.importorskip("libtpu", reason="the `tpu` extra brings libtpu")
    from configs.base import Config
    from configs.cli import parse
    from planning import aot, compile_store
    from trainer.program.mesh import build_mesh

    monkeypatch.setattr(compile_store, "STORE", str(tmp_path))  # compile now, not a stored compile
    cfg = parse(Config, TINY, default=configs.load("gpt2_124m"), prog="test")
    mesh = build_mesh(aot.for_topology(cfg, "v5e:2x2*2"), devices=aot.topology_devices("v5e:2x2*2"))
    # data 4 = 2 slices × 2, slice-major; each fsdp pair inside one slice
    assert dict(mesh.shape) == {"data": 4, "fsdp": 2, "tensor": 1}
    assert [[d.slice_index for d in row] for row in mesh.devices[:, :, 0]] == [[0, 0], [0, 0], [1, 1], [1, 1]]
    report = aot.compile_for_topology(cfg, "v5e:2x2*2")
    text = report.text()
    assert text.startswith("v5e:2x2*2 (8 chips in 2 slices), predicted from the compiled program, not measured")
    dcn = [c for c in report.step_time.collectives if c.over_dcn]
    assert [(c.kind, c.axis) for c in dcn] == [("all-reduce", "DCN (data across 2 slices)")]
    # a ring over 2 slices: the bytes once at the DCN rate, plus 2 (2-1) ring steps' latency per transfer
    assert dcn[0].count > 0 and dcn[0].seconds == pytest.approx(dcn[0].bytes / V5E.dcn_bytes_per_s
                                                                + dcn[0].count * 2 * DCN_STEP_S)
    assert "all-reduce over DCN (data across 2 slices):" in text and "DCN 3.12 GB/s per chip" in text
    # inside a slice the collectives run over its own 4 chips: fsdp, and the slice's part of data
    assert {c.axis for c in report.step_time.collectives if not c.over_dcn} <= {"fsdp", "data", "data+fsdp"}
    assert report.fits


RUN = [*SMALL, "--train.eval_every=4", "--checkpoint.every=4", "--mesh.fsdp=2"]


def test_two_slices_of_processes_train_as_one_slice_and_their_checkpoint_resumes_on_one(shakespeare, tmp_path):
    """2 processes × 4 CPU devices as 2 slices (data 4 = 2 slices × 2, fsdp 2 inside each) give the losses of one
    process of 8 devices; their checkpoint resumes on that single slice and continues with the same losses."""
    reference, two = tmp_path / "one_slice", tmp_path / "two_slices"
    code, _, err = run_main(train_app.main, "--run_dir", str(reference), f"--data.cache_dir={shakespeare}", *RUN,
                            "--train.steps=10")
    assert code == 0, err[-3000:]
    cmd = [sys.executable, "-m", "tools.launch", "--num_processes", "2", "--devices_per_process", "4", "--grace",
           "20", "--", sys.executable, "train.py", "--run_dir", str(two), f"--data.cache_dir={shakespeare}", *RUN,
           "--train.steps=8", "--mesh.num_slices=2"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "[p0] mesh     8 × cpu: data 4 (2 slices × 2) × fsdp 2 × tensor 1" in r.stdout
    np.testing.assert_allclose(step_losses(two), step_losses(reference)[:8], rtol=0, atol=1e-5)
    code, out, err = run_main(train_app.main, "--run_dir", str(two), f"--data.cache_dir={shakespeare}", *RUN,
                              "--train.steps=10")
    assert code == 0 and f"resumed from {two / 'checkpoints' / '8'}" in out, err[-3000:]
    np.testing.assert_allclose(step_losses(two), step_losses(reference), rtol=0, atol=1e-5)
