"""Numerical safety in the jitted train call: the spike guard skips a planted NaN step exactly as a run that never
saw its batch (any K, a sharded mesh), is bitwise a no-op until a lasting new level restarts it, and an unguarded
call reports a non-finite state. Faults are planted through TrainProgram._gradient_hook (tests/support/faults.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from configs.base import Config, GuardConfig
from support.faults import nan_gradient_at
from support.train_calls import BATCHES, NANO_RUN, call_metrics, one_device, param_diff, run_calls
from trainer.program.mesh import make_mesh
from trainer.program.train_program import TrainProgram


def guarded(cfg: Config, **guard) -> Config:
    return dataclasses.replace(cfg, guard=GuardConfig(skip_spikes=True, **guard))


def test_a_skipped_step_is_no_step_for_any_k_on_a_sharded_mesh(monkeypatch):
    """A NaN gradient at step 3 on a 2x2x2 mesh (data, fsdp, tensor): the guarded run (one K=4 call, and four
    K=1 calls) ends with the parameters of an unguarded run that never saw batch 3 (the optimizer's count, and
    so its schedule, skip it too)."""
    cfg = dataclasses.replace(NANO_RUN, mesh=dataclasses.replace(NANO_RUN.mesh, rules="fsdp_tp"))
    mesh = make_mesh(2, 2, 2, devices=jax.devices()[:8])
    # one step per call: the program test_train_step.py's K-step equivalence on this mesh compiles too
    reference, _ = run_calls(cfg, mesh, [BATCHES[i : i + 1] for i in (0, 1, 3)])
    nan_gradient_at(monkeypatch, 3)
    k4, (m4,) = call_metrics(guarded(cfg), mesh, [BATCHES])
    k1, m1 = call_metrics(guarded(cfg), mesh, [BATCHES[i : i + 1] for i in range(4)])
    assert m4["skipped"].tolist() == [0, 0, 1, 0] and [float(m["skipped"][0]) for m in m1] == [0, 0, 1, 0]
    np.testing.assert_array_equal(m4["loss"], np.concatenate([m["loss"] for m in m1]))
    for state in (k4, k1):
        assert param_diff(state["params"], reference["params"]) <= 1e-6
        assert int(state["step"]) == 4 and int(state["opt_state"].stats["skipped"]) == 1


def test_the_guard_is_bitwise_a_no_op_until_a_lasting_new_level_restarts_it(monkeypatch):
    """Gradients 100x larger from step 5 on. Steps 1-4 (nothing to skip) are bitwise the unguarded call's;
    steps 5-7 are skipped, and `warmup` (3) skips in a row restart the statistics, so step 8 is taken at the
    new level instead of every later step being skipped."""
    mesh = one_device()
    plain, (plain_metrics,) = call_metrics(NANO_RUN, mesh, [BATCHES])
    monkeypatch.setattr(TrainProgram, "_gradient_hook", lambda self, grads, step: jax.tree.map(
        lambda g: jnp.where(step + 1 >= 5, 100 * g, g), grads))
    more = np.random.RandomState(1).randint(0, 96, (4, 8, 17)).astype(np.int32)
    state, (metrics,) = call_metrics(guarded(NANO_RUN, warmup=3), mesh, [np.concatenate([BATCHES, more])])
    np.testing.assert_array_equal(metrics["loss"][:4], plain_metrics["loss"])  # each loss: the params before it
    assert np.array_equal(metrics["grad_norm"][:4], plain_metrics["grad_norm"]) and bool(plain_metrics["state_finite"])
    assert metrics["skipped"].tolist() == [0, 0, 0, 0, 1, 1, 1, 0]
    assert int(state["opt_state"].stats["accepted"]) == 1 and int(state["opt_state"].stats["streak"]) == 0


def test_unguarded_call_reports_a_non_finite_state(monkeypatch):
    nan_gradient_at(monkeypatch, 2)
    _, (metrics,) = call_metrics(NANO_RUN, one_device(), [BATCHES])
    assert not bool(metrics["state_finite"])
