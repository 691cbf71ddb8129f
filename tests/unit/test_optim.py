"""The optimizer: optim.name=muon puts optax's Muon on the hidden matrices and AdamW on the rest, with every
leaf in exactly one group; each group's update is that optimizer's own; the train call with Muon keeps its
equivalences (K steps in one call, gradient accumulation, any mesh, the spike guard, resume)."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from configs.base import CheckpointConfig, Config, TrainConfig
from gpt2 import GPT2Config
from trainer.program.mesh import make_mesh
from gpt2.model import GPT2
from gpt2.sharded_init import abstract_model
from gpt2.sharding import ShardingRules
from optim import GuardConfig, OptimizerConfig, ScheduleConfig, unguarded
from optim.adamw import AdamWConfig
from optim.base import decay_mask, parameters_per_group
from optim.muon import MuonConfig, muon_dimensions
from optim.schedules import CosineSchedule
from trainer.program.train_program import TrainProgram
from trainer.run.resume import check_same_schedule
from trainer.storage.checkpoints import CheckpointMismatch, Checkpoints, check_compatible
from support.faults import nan_gradient_at
from support.train_calls import BATCHES, call_metrics, one_device, param_diff, run_calls

MUON = MuonConfig(muon_lr=0.02)
MUON_RUN = Config(model=GPT2Config.nano(), train=TrainConfig(batch_size=8, seq_len=16, steps=10), optim=MUON,
                  schedule=CosineSchedule(warmup_steps=2))
NO_WARMUP = CosineSchedule(warmup_steps=0)
# gpt2/layers.py declares these four as hidden matrices (`hidden_matrix`): what Muon must own, by name
HIDDEN = {("attn", "c_attn", "kernel"), ("attn", "c_proj", "kernel"), ("mlp", "c_fc", "kernel"),
          ("mlp", "c_proj", "kernel")}


def abstract_params(config: GPT2Config) -> nnx.State:
    return nnx.state(abstract_model(config, ShardingRules.preset("dp")), nnx.Param)


def groups(params: nnx.State) -> dict[tuple, str]:
    return {path: MUON.group_of(path, v) for path, v in nnx.to_flat_state(params)}


@pytest.mark.parametrize("scan", [True, False])
def test_every_leaf_is_in_exactly_one_group_the_hidden_matrices_in_muons(scan):
    params = abstract_params(dataclasses.replace(GPT2Config.nano(), scan_layers=scan))
    labels = groups(params)
    assert set(labels) == {path for path, _ in nnx.to_flat_state(params)}
    assert set(labels.values()) == {"lr/muon", "lr"}
    muon = {path[-3:] for path, label in labels.items() if label == "lr/muon"}
    assert muon == HIDDEN  # attention's c_attn and c_proj, the MLP's c_fc and c_proj kernels
    for path, label in labels.items():  # embeddings (wte is the tied head too), norms and biases: AdamW
        if path[-1] in ("embedding", "bias", "scale"):
            assert label == "lr", path


def test_the_124m_partition_scanned_and_unscanned():
    """Muon owns 12 layers × 12·D² (q, k, v, the attention output and the two MLP matrices) of GPT-2 124M."""
    counts = {}
    for scan in (True, False):
        params = abstract_params(dataclasses.replace(GPT2Config.gpt2(), scan_layers=scan))
        counts[scan] = parameters_per_group(MUON, params)
    assert counts[True] == counts[False]
    assert counts[True]["lr/muon"] == 12 * 12 * 768**2 == 84_934_656
    assert counts[True]["lr/muon"] + counts[True]["lr"] == GPT2Config.gpt2().num_params()


def test_each_group_gets_its_own_optimizers_update():
    """Through the partition, a scanned [L, ...] Muon leaf gets exactly what optax's Muon gives that array
    alone (orthogonalized per layer and per q/k/v), and an AdamW leaf what AdamW gives it alone."""
    params = nnx.state(GPT2(GPT2Config.nano(), rngs=nnx.Rngs(0)), nnx.Param)
    keys = iter(jax.random.split(jax.random.PRNGKey(1), 64))
    grads = jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape), params)
    cfg = dataclasses.replace(MUON, grad_clip=0.0)
    tx = unguarded(cfg, NO_WARMUP, 10)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)  # eager Muon: ~20 s of op-by-op dispatch
    flat = lambda tree: {p: v.get_value() for p, v in nnx.to_flat_state(tree)}  # noqa: E731
    u, g, p = flat(updates), flat(grads), flat(params)
    variables = dict(nnx.to_flat_state(params))
    for path in (("h", "attn", "c_attn", "kernel"), ("h", "mlp", "c_proj", "kernel")):
        alone = optax.contrib.muon(NO_WARMUP.rate(cfg.muon_lr, 10), ns_coeffs=cfg.muon_ns_coeffs,
                                   beta=cfg.muon_momentum,
                                   muon_weight_dimension_numbers=muon_dimensions(variables[path]))
        expected, _ = jax.jit(alone.update)(g[path], alone.init(p[path]), p[path])
        np.testing.assert_allclose(u[path], expected, rtol=0, atol=1e-7)
    q_update = u[("h", "attn", "c_attn", "kernel")][0, :, 0].reshape(p[("wte", "embedding")].shape[1], -1)
    singular = np.linalg.svd(np.asarray(q_update), compute_uv=False)
    assert singular.max() / singular.min() < 2  # Newton–Schulz: nearly orthogonal (not exact by design)
    path = ("wte", "embedding")
    alone = optax.adamw(NO_WARMUP.rate(cfg.lr, 10), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)
    expected, _ = alone.update(g[path], alone.init(p[path]), p[path])
    np.testing.assert_allclose(u[path], expected, rtol=0, atol=1e-9)


def test_muon_keeps_the_train_calls_equivalences():
    """With Muon and the spike guard, one call of K=4 steps on one device equals 4 calls of one step with
    2 micro-batches each on a 2×2×2 fsdp_tp mesh (float32; the tolerance of the AdamW equivalences)."""
    cfg = dataclasses.replace(MUON_RUN, guard=GuardConfig(skip_spikes=True))
    scanned, losses_k4 = run_calls(cfg, one_device(), [BATCHES])
    other = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, rules="fsdp_tp"),
                                train=dataclasses.replace(cfg.train, grad_accum=2))
    looped, losses_k1 = run_calls(other, make_mesh(2, 2, 2, devices=jax.devices()),
                                  [BATCHES[i: i + 1] for i in range(4)])
    np.testing.assert_allclose(losses_k4, losses_k1, rtol=0, atol=1e-5)
    assert param_diff(scanned["params"], looped["params"]) <= 1e-5
    assert int(scanned["step"]) == int(looped["step"]) == 4


def test_muon_state_resumes_bitwise(tmp_path):
    """Two calls equal one call, a checkpoint of Muon's state (momenta inside optax's partition) and a restored
    second call."""
    program = TrainProgram.build(MUON_RUN, one_device())
    with jax.set_mesh(program.mesh):
        call = program.train_call()
        state = program.init_state()
        first, second = (jax.device_put(b, program.batch_sharding) for b in (BATCHES[:2], BATCHES[2:]))
        state, _ = call(state, first, np.ones(2, bool))
        ckpt = Checkpoints(tmp_path, CheckpointConfig(async_save=False))
        ckpt.save(2, state, None, {"config": {}})
        straight, _ = call(state, second, np.ones(2, bool))
        straight = jax.device_get(straight)
        restored = ckpt.restore(2, program.abstract_state())
        ckpt.close()
        resumed, _ = call(restored, second, np.ones(2, bool))
    assert jax.tree.structure(resumed) == jax.tree.structure(straight)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(jax.device_get(resumed)),
                                                     jax.tree.leaves(straight)))


def test_adamw_default_is_unchanged():
    """optim.name=adamw is the chain it was before Muon existed (clipping, then AdamW masked to matrices and
    embeddings), bit for bit, and owns every parameter."""
    params = nnx.state(GPT2(GPT2Config.nano(), rngs=nnx.Rngs(0)), nnx.Param)
    keys = iter(jax.random.split(jax.random.PRNGKey(2), 64))
    grads = jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape), params)
    cfg = AdamWConfig()
    before = optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                         optax.adamw(NO_WARMUP.rate(cfg.lr, 10), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                                     weight_decay=cfg.weight_decay, mask=decay_mask))
    ours, expected = unguarded(cfg, NO_WARMUP, 10), before
    assert jax.tree.structure(ours.init(params)) == jax.tree.structure(expected.init(params))
    a, _ = ours.update(grads, ours.init(params), params)
    b, _ = expected.update(grads, expected.init(params), params)
    assert param_diff(a, b) == 0
    assert parameters_per_group(cfg, params) == {"lr": GPT2Config.nano().num_params()}


def test_a_checkpoint_of_the_other_optimizer_is_refused_in_one_line():
    saved = {"config": {"model": dataclasses.asdict(MUON_RUN.model), "optim": {"name": "adamw"}}}
    with pytest.raises(CheckpointMismatch, match="optim.name: checkpoint 'adamw' vs config 'muon'"):
        check_compatible(saved, MUON_RUN, "run/checkpoints/4")


def test_each_groups_logged_rate_is_its_own_schedule_at_the_applied_updates(monkeypatch):
    """Muon with the spike guard and a NaN gradient at step 2 (skipped): each step reports both groups' rates, each
    its own peak on the schedule read at the updates applied before it, so the skipped step's rate is repeated by
    the step after it (the schedule moves with applied updates only)."""
    nan_gradient_at(monkeypatch, 2)
    cfg = dataclasses.replace(MUON_RUN, guard=GuardConfig(skip_spikes=True))
    _, (metrics,) = call_metrics(cfg, one_device(), [BATCHES])
    assert metrics["skipped"].tolist() == [0, 1, 0, 0]
    applied = [0, 1, 1, 2]
    for group, peak in (("lr", MUON.lr), ("lr/muon", MUON.muon_lr)):
        expected = [float(cfg.schedule.rate(peak, cfg.train.steps)(n)) for n in applied]
        np.testing.assert_allclose(metrics[group], expected, rtol=1e-6)
    assert metrics["lr/muon"][3] / metrics["lr"][3] == pytest.approx(MUON.muon_lr / MUON.lr)


def changed(value):
    """Another valid value of a config field's: a different number (0 -> 0.5), None made a number, a tuple's parts
    halved."""
    if isinstance(value, bool):
        return not value
    if value is None:
        return 7
    if isinstance(value, tuple):
        return tuple(v / 2 for v in value)
    return value + 1 if isinstance(value, int) else value / 2 if value else 0.5


@pytest.mark.parametrize("section, family", [("optim", OptimizerConfig), ("schedule", ScheduleConfig)])
def test_a_resume_refuses_a_change_to_any_field_of_any_optimizer_or_schedule(section, family):
    """No hand-kept list: every field of every registered variant (a new one included) changes the run's learning
    rates, and a resume that changes one is refused naming it, unless train.reschedule allows it."""
    for name, variant in family.variants.items():
        run = dataclasses.replace(MUON_RUN, **{section: variant()})
        saved = {"config": dataclasses.asdict(run)}
        for f in dataclasses.fields(variant):
            if f.name == "name":
                continue
            other = dataclasses.replace(run, **{section: dataclasses.replace(getattr(run, section),
                                                                              **{f.name: changed(f.default)})})
            refused = f"resuming would change the optimizer or its schedule [(]{section}.{f.name}: "
            with pytest.raises(CheckpointMismatch, match=refused):
                check_same_schedule(saved, other, "run/checkpoints/4")
            allowed = dataclasses.replace(other, train=dataclasses.replace(other.train, reschedule=True))
            check_same_schedule(saved, allowed, "run/checkpoints/4")
        check_same_schedule(saved, run, "run/checkpoints/4")  # the same config resumes
