"""The real jitted train call driven by hand: K-step calls over fixed random batches, on a chosen mesh."""

import jax
import numpy as np

from configs.base import Config
from trainer.program.mesh import make_mesh
from trainer.program.train_program import TrainProgram

BATCHES = np.random.RandomState(0).randint(0, 96, (4, 8, 17)).astype(np.int32)  # [K, B, T+1]


def one_device():
    return make_mesh(1, 1, 1, devices=jax.devices()[:1])


def run_calls(cfg: Config, mesh, stacks, active=None, program: TrainProgram | None = None):
    """Runs one train call per [K, B, T+1] stack (all steps active unless `active` says otherwise), of `program`
    (default: the one `cfg` builds on `mesh`)."""
    trainer = program or TrainProgram.build(cfg, mesh)
    with jax.set_mesh(mesh):
        call = trainer.train_call()
        state = trainer.init_state()
        losses = []
        for i, stack in enumerate(stacks):
            on = np.ones(len(stack), bool) if active is None else active[i]
            state, metrics = call(state, jax.device_put(stack, trainer.batch_sharding), on)
            losses.extend(np.asarray(metrics["loss"])[on].tolist())
        return state, losses


def param_diff(a, b) -> float:
    """The largest absolute difference between two trees of arrays, in NumPy (on the host: JAX would compile
    three programs per leaf shape and layout)."""
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.abs(np.asarray(x) - np.asarray(y)).max()), a, b)))
