"""μP end to end: the pod preset compiles for a TPU topology (the rest of μP's checks: tests/unit/test_mup.py)."""

import dataclasses

import pytest

import configs
from configs.base import Config
from gpt2.config import GPT2Config

torch = pytest.importorskip("torch", reason="the reference implementations are PyTorch's (the `hf` extra)")
mup = pytest.importorskip("mup", reason="the reference μP (`mup` on PyPI) is a dev extra")

# m = 4: every μP multiplier differs from the standard one by at least 2×; head dim 64 at the base width
BASE = GPT2Config(vocab_size=64, block_size=16, n_layer=2, n_head=1, n_embd=64, scan_layers=False,
                  parametrization="mup", mup_base_width=64)
WIDE = dataclasses.replace(BASE, n_embd=256, n_head=2)


def test_the_mup_pod_preset_compiles_for_a_tpu_topology():
    """gpt2_xl_pod_mup's train call (μP's optimizer chain and multipliers, its mesh rules), shrunk to one layer at
    width 256 (m = 2), compiles for v5e:2x2 as `plan.py --topology` compiles it."""
    pytest.importorskip("libtpu", reason="the `tpu` extra brings libtpu")
    from configs.cli import parse
    from planning import aot

    small = ["--model.n_layer=1", "--model.n_head=4", "--model.n_embd=256", "--model.block_size=128",
             "--model.vocab_size=512", "--train.seq_len=128", "--train.batch_size=8", "--train.steps_per_call=1"]
    cfg = parse(Config, small, default=configs.load("gpt2_xl_pod_mup"), prog="test")
    assert cfg.model.width_mult == 2.0
    report = aot.compile_for_topology(cfg, "v5e:2x2")
    assert report.fits and "  fits        yes," in report.text() and report.step_time is not None
