"""Wrote this directory with the trainer at 5f6b514 (before the spike guard's statistics moved into the optimizer
state): `git worktree add /tmp/old 5f6b514 && cd /tmp/old && PYTHONPATH=. python .../make.py OUT`. For each of
guard on (`guard/`) and off (`plain/`): a checkpoint at step 4 and state.npz, the state's leaves by path plus the
parameters after one more call ("next..."), which tests/unit/test_checkpoint_compat.py compares a restore with."""

import dataclasses
import sys

import jax
import numpy as np

from configs.base import Config, GuardConfig, OptimConfig, TrainConfig
from gpt2 import GPT2Config, make_mesh
from trainer.program.train_program import TrainProgram
from trainer.storage.checkpoints import Checkpoints

out = sys.argv[1]
BATCHES = np.random.RandomState(0).randint(0, 96, (4, 8, 17)).astype(np.int32)
for name, guard in (("guard", GuardConfig(skip_spikes=True, warmup=3)), ("plain", GuardConfig())):
    cfg = Config(model=GPT2Config.nano(n_layer=1, n_embd=16), train=TrainConfig(batch_size=8, seq_len=16, steps=10,
                 steps_per_call=4), optim=OptimConfig(warmup_steps=2), guard=guard)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    program = TrainProgram.build(cfg, mesh)
    with jax.set_mesh(mesh):
        state, _ = program.train_call()(program.init_state(), jax.device_put(BATCHES, program.batch_sharding),
                                        np.ones(4, bool))
        ckpt = Checkpoints(f"{out}/{name}", dataclasses.replace(cfg.checkpoint, async_save=False))
        ckpt.save(4, state, None, {"config": dataclasses.asdict(cfg)})
        ckpt.wait()
        ckpt.close()
    leaves = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(state)}
    with jax.set_mesh(mesh):  # the next call, on other batches: what a resume must reproduce
        state, _ = program.train_call()(state, jax.device_put(BATCHES[::-1], program.batch_sharding), np.ones(4, bool))
    leaves |= {"next" + jax.tree_util.keystr(k): np.asarray(v)
               for k, v in jax.tree_util.tree_leaves_with_path(state["params"])}
    np.savez_compressed(f"{out}/{name}/state.npz", **leaves)
