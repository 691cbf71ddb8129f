"""docs/extending.md as written: its optimizer and its schedule, each one class that registers itself, are flags,
optimizers and resume checks at once; a metric the train step returns reaches the record of every step."""

import dataclasses
import json
import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import optim
from configs.base import Config
from configs.cli import parse
from gpt2 import GPT2, GPT2Config
from optim import OptimizerConfig, ScheduleConfig
from support.cli import ROOT
from trainer.run.resume import check_same_schedule
from trainer.storage.checkpoints import CheckpointMismatch


@pytest.fixture
def extended():
    """The page's classes, registered for this test only (taken out of the registries after it)."""
    before = {family: set(family.variants) for family in (OptimizerConfig, ScheduleConfig)}
    page = (ROOT / "docs" / "extending.md").read_text()
    blocks = re.findall(r"<!-- extending test: python -->\n```python\n(.*?)```", page, flags=re.S)
    assert len(blocks) == 2
    namespace = {"__name__": "optim.extending_example"}
    try:
        for block in blocks:
            exec(compile(block, "docs/extending.md", "exec"), namespace)
        yield namespace
    finally:
        for family, names in before.items():
            for name in set(family.variants) - names:
                del family.variants[name]


def test_the_pages_optimizer_is_a_flag_and_its_update_is_optaxs(extended):
    cfg = parse(Config, ["--optim.name=lion", "--optim.lr=1e-4", "--optim.b2=0.98"], presets=True, prog="t")
    assert isinstance(cfg.optim, extended["LionConfig"]) and (cfg.optim.lr, cfg.optim.b2) == (1e-4, 0.98)
    params = nnx.state(GPT2(GPT2Config.nano(), rngs=nnx.Rngs(0)), nnx.Param)
    grads = jax.tree.map(lambda x: jax.random.normal(jax.random.PRNGKey(1), x.shape), params)
    tx = optim.unguarded(cfg.optim, cfg.schedule, 100)
    ours, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    lion = optax.chain(optax.clip_by_global_norm(1.0), optax.lion(cfg.schedule.rate(1e-4, 100), b1=0.9, b2=0.98,
                                                                  weight_decay=1.0, mask=optim.base.decay_mask))
    theirs, _ = jax.jit(lion.update)(grads, lion.init(params), params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)))
    assert cfg.optim.describe(params).startswith("lion (lr 0.0001) on ")


def test_the_pages_schedule_is_a_flag_a_rate_and_a_resume_check(extended):
    cfg = parse(Config, ["--schedule.name=rsqrt", "--schedule.warmup_steps=100"], presets=True, prog="t")
    rate = cfg.schedule.rate(1.0, cfg.train.steps)
    assert [float(rate(n)) for n in (0, 50, 100, 400)] == pytest.approx([0.0, 0.5, 1.0, 0.5])
    saved = {"config": json.loads(json.dumps(dataclasses.asdict(cfg)))}
    longer = parse(Config, ["--schedule.name=rsqrt", "--schedule.warmup_steps=100", "--train.steps=2000"],
                   presets=True, prog="t")
    check_same_schedule(saved, longer, "run/checkpoints/600")  # no end: extending keeps every rate
    warmer = parse(Config, ["--schedule.name=rsqrt", "--schedule.warmup_steps=200"], presets=True, prog="t")
    refused = r"the optimizer or its schedule \(schedule.warmup_steps: 100 -> 200\)"
    with pytest.raises(CheckpointMismatch, match=refused):
        check_same_schedule(saved, warmer, "run/checkpoints/600")


def test_a_metric_the_step_returns_is_logged_with_no_other_edit(monkeypatch):
    """The page's metric, as the host meets it: a call's metrics with one more entry (the device side returns its
    dict whole: test_optim.py's group rates are such entries), and the record metrics.jsonl and wandb get holds it
    for each step, beside every other metric the step reported."""
    from types import SimpleNamespace

    from configs.base import Config
    from trainer.run.observers import FinishedCall, Progress

    cfg = Config()
    program = SimpleNamespace(optimizer=SimpleNamespace(notes=lambda record: []), on_step=None)
    progress = Progress(SimpleNamespace(cfg=cfg, program=program), SimpleNamespace(active=False), 1e12, 0)
    metrics = {"loss": np.array([3.0, 2.5]), "grad_norm": np.array([1.0, 0.5]), "lr": np.array([0.0, 1e-4]),
               "param_norm": np.array([12.0, 12.5]), "state_finite": np.array(True)}
    call = FinishedCall(0, metrics, None, 0.0, None)
    records = [progress.record(call, i, None, None) for i in range(2)]
    assert [r["param_norm"] for r in records] == [12.0, 12.5] and [r["step"] for r in records] == [1, 2]
    assert all("state_finite" not in r for r in records)  # one per call, not per step
