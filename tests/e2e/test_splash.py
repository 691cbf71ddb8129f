"""Splash attention compiled for a TPU topology with libtpu (no TPU): "auto" picks the kernel when the mesh's devices
are TPUs. gpt2_124m's train call with it, compiled for v5e:2x4: tests/e2e/test_aot.py. The kernel's numbers, run in
Pallas's interpret mode on CPU: tests/unit/test_splash.py.
"""

import subprocess
import sys

import pytest

from support.cli import ROOT, cli_env

AUTO_ON_TPU = """
import numpy as np, jax, jax.numpy as jnp
from flax import nnx
from jax.experimental import topologies
from gpt2 import GPT2, GPT2Config
from gpt2.sharding import ShardingRules
topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2", chip_config_name="default",
                                    chips_per_host_bounds=(2, 2, 1), num_slices=1)
mesh = jax.sharding.Mesh(np.array(topo.devices).reshape(4, 1, 1), ("data", "fsdp", "tensor"))
config = GPT2Config(vocab_size=96, n_layer=1, n_head=2, n_embd=128, block_size=256)
model = nnx.eval_shape(lambda: GPT2(config, rngs=nnx.Rngs(0), rules=ShardingRules.preset("dp")))
graphdef, state = nnx.split(model)
with jax.set_mesh(mesh):
    lowered = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, jax.ShapeDtypeStruct((4, 256), jnp.int32))
print("tpu_custom_call" in lowered.as_text())
"""


def test_auto_picks_the_compiled_kernel_for_a_tpu_topology():
    """The process's backend is CPU, the mesh's devices are TPUs: "auto" must be splash, not interpreted."""
    pytest.importorskip("libtpu", reason="the `tpu` extra brings libtpu")
    r = subprocess.run([sys.executable, "-c", AUTO_ON_TPU], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=cli_env(1, {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "True"
