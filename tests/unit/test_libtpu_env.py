"""libtpu's environment in one place (trainer/libtpu_env.py): the generation's collective flags on a TPU unless the
user set their own, libtpu told it runs on one host of its own without a TPU, and every shipped flag one the
installed libtpu knows. The entry points' stderr without a TPU: tests/e2e/test_aot.py."""

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another process may hold libtpu's lock file

import pytest  # noqa: E402
from jax._src import hardware_utils  # noqa: E402

from trainer import libtpu_env  # noqa: E402


def test_on_a_tpu_the_generations_flags_are_set_unless_the_user_set_their_own(monkeypatch):
    monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id",
                        lambda: (8, hardware_utils.TpuVersion.v5e))
    environ = {}
    libtpu_env.configure(environ)
    assert environ == {"LIBTPU_INIT_ARGS": libtpu_env.COLLECTIVE_FLAGS["v5e"].init_args()}
    assert "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true" in environ["LIBTPU_INIT_ARGS"]
    mine = {"LIBTPU_INIT_ARGS": "--xla_enable_async_all_gather=false"}
    libtpu_env.configure(mine)
    assert mine == {"LIBTPU_INIT_ARGS": "--xla_enable_async_all_gather=false"}


def test_without_a_tpu_libtpu_is_told_it_runs_on_one_host_of_its_own(monkeypatch):
    monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id", lambda: (0, None))
    environ = {"TPU_WORKER_HOSTNAMES": "10.0.0.2"}  # a user's value is kept
    libtpu_env.configure(environ)
    assert environ == {"TPU_WORKER_HOSTNAMES": "10.0.0.2", "TPU_HOST_BOUNDS": "1,1,1"}


def test_a_compile_for_a_generation_uses_its_flags_unless_the_user_set_theirs(monkeypatch):
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    assert libtpu_env.compile_options("v5e") == libtpu_env.COLLECTIVE_FLAGS["v5e"].flags
    assert libtpu_env.compile_options("v9x") == {}
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_enable_async_collective_fusion=true")
    assert libtpu_env.compile_options("v5e") == {}  # theirs reach libtpu through the environment; ours are not added


def test_every_generation_names_its_source_at_a_commit():
    for generation, shipped in libtpu_env.COLLECTIVE_FLAGS.items():
        assert "@" in shipped.source and shipped.flags, generation
        assert all(len(commit) >= 7 for commit in (part.split("@")[1].split()[0] for part in
                                                   shipped.source.split() if "@" in part))


@pytest.mark.parametrize("generation", ["v4", "v5e", "v5p", "v6e"])
def test_every_shipped_flag_is_one_the_installed_libtpu_knows(generation, monkeypatch):
    """A flag libtpu does not know fails the compile ("No such compile option"): each generation's flags compile a
    small sharded matmul for its topology."""
    pytest.importorskip("libtpu", reason="the `tpu` extra brings libtpu")
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from planning.aot import topology_devices

    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    topology = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}[generation]
    mesh = jax.make_mesh((4,), ("fsdp",), devices=topology_devices(topology), axis_types=(jax.sharding.AxisType.Auto,))
    x, w = (jax.ShapeDtypeStruct((512, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp"))) for _ in "xw")
    options = libtpu_env.compile_options(generation)
    assert options == libtpu_env.COLLECTIVE_FLAGS[generation].flags and options
    with jax.set_mesh(mesh):
        jax.jit(lambda x, w: x @ w.T).lower(x, w).compile(compiler_options=options)
