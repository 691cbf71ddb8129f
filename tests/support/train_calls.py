"""The real jitted train call driven by hand: K-step calls over fixed random batches, on a chosen mesh."""

import jax
import numpy as np

from configs.base import Config, TrainConfig
from optim.schedules import CosineSchedule
from gpt2 import GPT2Config
from trainer.program.mesh import make_mesh
from trainer.program.train_program import TrainProgram

# The unit tier's train calls: one config and one set of batches, so that tests of different properties that need
# the same program (the session's compilation cache is keyed by it) compile it once between them.
NANO_RUN = Config(model=GPT2Config.nano(), train=TrainConfig(batch_size=8, seq_len=16, steps=10),
                  schedule=CosineSchedule(warmup_steps=2))
BATCHES = np.random.RandomState(0).randint(0, 96, (4, 8, 17)).astype(np.int32)  # [K, B, T+1]


def one_device():
    return make_mesh(1, 1, 1, devices=jax.devices()[:1])


def call_metrics(cfg: Config, mesh, stacks, active=None, program: TrainProgram | None = None):
    """Runs one train call per [K, B, T+1] stack (all steps active unless `active` says otherwise), of `program`
    (default: the one `cfg` builds on `mesh`): (the final state, each call's metrics on the host)."""
    trainer = program or TrainProgram.build(cfg, mesh)
    with jax.set_mesh(mesh):
        call, state, out = trainer.train_call(), trainer.init_state(), []
        for stack, on in zip(stacks, all_active(stacks, active)):
            state, metrics = call(state, jax.device_put(stack, trainer.batch_sharding), on)
            out.append(jax.device_get(metrics))
        return state, out


def run_calls(cfg: Config, mesh, stacks, active=None, program: TrainProgram | None = None):
    """call_metrics, with the losses of the active steps in order instead of the metrics."""
    state, metrics = call_metrics(cfg, mesh, stacks, active, program)
    return state, [loss for m, on in zip(metrics, all_active(stacks, active)) for loss in m["loss"][on].tolist()]


def all_active(stacks, active=None) -> list:
    """`active`, or every step of every stack."""
    return active or [np.ones(len(stack), bool) for stack in stacks]


def param_diff(a, b) -> float:
    """The largest absolute difference between two trees of arrays, in NumPy (on the host: JAX would compile
    three programs per leaf shape and layout)."""
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.abs(np.asarray(x) - np.asarray(y)).max()), a, b)))
