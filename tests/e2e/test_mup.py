"""μP end to end: the pod preset compiles for a TPU topology (the rest of μP's checks: tests/unit/test_mup.py)."""

import pytest

import configs
from configs.base import Config


def test_the_mup_pod_preset_compiles_for_a_tpu_topology():
    """gpt2_xl_pod_mup's train call (μP's optimizer chain and multipliers, CompleteP's branch multiplier, its mesh
    rules), shrunk to 4 layers at width 256 (m = 8, 2× the base depth), compiles for v5e:2x2 as `plan.py
    --topology` compiles it."""
    pytest.importorskip("libtpu", reason="the `tpu` extra brings libtpu")
    from configs.cli import parse
    from planning import aot

    small = ["--model.n_layer=4", "--model.n_head=4", "--model.n_embd=256", "--model.block_size=128",
             "--model.vocab_size=512", "--train.seq_len=128", "--train.batch_size=8", "--train.steps_per_call=1"]
    cfg = parse(Config, small, default=configs.load("gpt2_xl_pod_mup"), prog="test")
    assert cfg.model.width_mult == 8.0 and cfg.model.residual_multiplier == 0.5
    report = aot.compile_for_topology(cfg, "v5e:2x2")
    assert report.fits and "  fits        yes," in report.text() and report.step_time is not None
