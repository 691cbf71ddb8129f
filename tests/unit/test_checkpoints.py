"""How a save is written: Orbax's replica-parallel saving where its device ops pay for themselves.
(Whole runs' checkpoints: tests/e2e; checkpoints of earlier releases: test_checkpoint_compat.py.)"""

import dataclasses

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from configs.base import CheckpointConfig
from trainer.program.mesh import make_mesh
from trainer.storage.checkpoints import MIN_REPLICA_SLICE_BYTES, Checkpoints


def test_a_replicated_array_is_split_among_its_replicas_only_when_each_slice_is_worth_a_device_op(
        tmp_path, monkeypatch):
    """Orbax's replica-parallel saving slices each replicated shard among its replicas, one device op a slice:
    an array of under MIN_REPLICA_SLICE_BYTES a slice is written whole by one replica, a larger one in 8 slices,
    and both read back exactly."""
    mesh = make_mesh(8, 1, 1, devices=jax.devices()[:8])
    replicated = NamedSharding(mesh, PartitionSpec())
    rows = MIN_REPLICA_SLICE_BYTES // 4 // 64  # float32 rows of 64 per slice at the gate
    state = {"small": np.arange(64 * 64, dtype=np.float32).reshape(64, 64),
             "large": np.arange(8 * rows * 64, dtype=np.float32).reshape(8 * rows, 64)}
    slices = []
    slice_in_dim = jax.lax.slice_in_dim
    monkeypatch.setattr(jax.lax, "slice_in_dim", lambda x, *a, **k: slices.append(x.shape) or slice_in_dim(x, *a, **k))
    ckpt = Checkpoints(tmp_path, dataclasses.replace(CheckpointConfig(), async_save=False))
    ckpt.save(1, jax.device_put(state, replicated), None, {"config": {}})
    ckpt.wait()
    assert slices == [(8 * rows, 64)] * 8  # the large array's 8 replicas, a slice each; the small one unsliced
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=replicated) for k, v in state.items()}
    restored = ckpt.restore(1, abstract)
    ckpt.close()
    for k in state:
        np.testing.assert_array_equal(np.asarray(restored[k]), state[k])
