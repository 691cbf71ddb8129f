"""Checkpoints from earlier releases load: tests/support/golden/checkpoints_5f6b514/ was written by the trainer at 5f6b514
(before the spike guard's statistics moved into the optimizer state; make.py there wrote it), with the spike guard
on (`guard`) and off (`plain`). Each restores into today's train state with every value as saved, with the guard on
or off, and continues exactly as the old trainer did (its parameters after the next call are in state.npz)."""

import dataclasses

import jax
import numpy as np
import pytest

from support.cli import ROOT
from configs.base import CheckpointConfig, Config, TrainConfig
from optim import GuardConfig
from optim.schedules import CosineSchedule
from gpt2 import GPT2Config
from trainer.program.mesh import make_mesh
from trainer.program.train_program import TrainProgram
from trainer.storage.checkpoints import Checkpoints

GOLDEN = ROOT / "tests" / "support" / "golden" / "checkpoints_5f6b514"
BATCHES = np.random.RandomState(0).randint(0, 96, (4, 8, 17)).astype(np.int32)  # make.py's


def program(skip_spikes: bool) -> TrainProgram:
    cfg = Config(model=GPT2Config.nano(n_layer=1, n_embd=16), train=TrainConfig(batch_size=8, seq_len=16, steps=10,
                 steps_per_call=4), schedule=CosineSchedule(warmup_steps=2), guard=GuardConfig(skip_spikes=skip_spikes,
                                                                                          warmup=3))
    return TrainProgram.build(cfg, make_mesh(1, 1, 1, devices=jax.devices()[:1]))


def restore(saved: str, p: TrainProgram, tmp_path):
    ckpt = Checkpoints(GOLDEN / saved, CheckpointConfig(), read_only=True)
    target, upgrade = p.restore_target(ckpt.read_meta(4))
    with jax.set_mesh(p.mesh):
        state = upgrade(ckpt.restore(4, target))
    ckpt.close()
    return state


def old_name(path: str) -> str:
    """Today's leaf path as the old layout named it: the optimizer state was `opt_state`, the statistics `guard`."""
    return path.replace("['opt_state'].inner", "['opt_state']").replace("['opt_state'].stats", "['guard']")


@pytest.mark.parametrize("saved, guard_now", [("guard", True), ("plain", False), ("guard", False), ("plain", True)])
def test_a_checkpoint_from_5f6b514_restores_and_continues_exactly(saved, guard_now, tmp_path):
    expected = np.load(GOLDEN / saved / "state.npz")
    p = program(guard_now)
    state = restore(saved, p, tmp_path)
    leaves = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(state)}
    for path, value in leaves.items():
        if old_name(path) in expected:
            np.testing.assert_array_equal(value, expected[old_name(path)], err_msg=path)
        else:  # a run saved with the guard off has no statistics: they start afresh
            assert saved == "plain" and "['opt_state'].stats" in path and not value.any(), path
    assert {old_name(k) for k in leaves} >= {k for k in expected if not k.startswith("next")}
    with jax.set_mesh(p.mesh):
        state, _ = p.train_call()(state, jax.device_put(BATCHES[::-1], p.batch_sharding), np.ones(4, bool))
    for k, v in jax.tree_util.tree_leaves_with_path(state["params"]):
        # the old trainer's next call: the same program up to XLA's fusion choices
        np.testing.assert_allclose(np.asarray(v), expected["next" + jax.tree_util.keystr(k)], rtol=1e-5, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(k))


def test_a_new_checkpoint_records_its_state_format(tmp_path):
    p = program(True)
    with jax.set_mesh(p.mesh):
        state = p.init_state()
        ckpt = Checkpoints(tmp_path, dataclasses.replace(CheckpointConfig(), async_save=False))
        from trainer.program.train_program import STATE_FORMAT
        ckpt.save(1, state, None, {"config": dataclasses.asdict(p.config), "state_format": STATE_FORMAT})
        ckpt.wait()
        target, _ = p.restore_target(ckpt.read_meta(1))
        restored = ckpt.restore(1, target)
    ckpt.close()
    assert jax.tree.structure(restored) == jax.tree.structure(state)
