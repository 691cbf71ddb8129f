"""Creating a GPT-2 that is born sharded, and reporting where every parameter lives."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from gpt2.config import ConfigError, GPT2Config
from gpt2.model import GPT2
from gpt2.sharding import ShardingRules, logical_axes_of, named_shardings


def _resolve(rules: ShardingRules | str) -> ShardingRules:
    return ShardingRules.preset(rules) if isinstance(rules, str) else rules


def abstract_model(config: GPT2Config, rules: ShardingRules | str, seed: int = 0) -> GPT2:
    """The model with ShapeDtypeStructs instead of arrays: no memory, no FLOPs."""
    rules = _resolve(rules)
    # Under a mesh, eval_shape attaches shardings; the flax rules context lets it resolve logical names.
    with nnx.logical_axis_rules(rules.flax_rules()):
        return nnx.eval_shape(lambda: GPT2(config, rngs=nnx.Rngs(seed), rules=rules))


def model_shardings(config: GPT2Config, mesh: Mesh, rules: ShardingRules | str):
    """An nnx.State of NamedShardings, one per parameter, from the logical names and the table."""
    return named_shardings(nnx.state(abstract_model(config, rules)), mesh, _resolve(rules))


def new_model(config: GPT2Config, rules: ShardingRules, seed: int) -> GPT2:
    """A freshly initialized model: the one definition of GPT-2's initialization from a seed, traced inside the
    programs that make it born sharded (`create_sharded_model`, and the training's whole fresh state:
    trainer/program/train_program.py `init_state`)."""
    return GPT2(config, rngs=nnx.Rngs(seed), rules=rules)


def new_params(config: GPT2Config, rules: ShardingRules, seed: int) -> nnx.State:
    return nnx.state(new_model(config, rules, seed), nnx.Param)


def create_sharded_model(
    config: GPT2Config, mesh: Mesh, rules: ShardingRules | str, *, seed: int = 0
) -> GPT2:
    """Initializes GPT-2 directly into its sharded layout (the NNX "born sharded" pattern).

    Inside one jitted function the module is built, its state is constrained to the shardings the table
    gives, and written back; XLA's partitioner pushes the constraint into the random-number generation, so
    each device only ever materializes its own shard.
    """
    rules = _resolve(rules)
    shardings = model_shardings(config, mesh, rules)

    @nnx.jit
    def init() -> GPT2:
        model = new_model(config, rules, seed)
        state = jax.lax.with_sharding_constraint(nnx.state(model), shardings)
        nnx.update(model, state)
        return model

    with jax.set_mesh(mesh):
        model = init()
    # jit may label an equivalent layout differently (P() for a size-1 axis); relabel with the table's
    # specs (no data moves) so later jitted calls see exactly the shardings they were compiled for
    nnx.update(model, jax.device_put(nnx.state(model), shardings))
    return model


def param_report(model: GPT2, mesh: Mesh | None = None) -> str:
    """One row per parameter: path, shape, logical axes, mesh partition, bytes held by each device."""
    rows = [("parameter", "shape", "logical axes", "partition", "bytes/device")]
    total_bytes = 0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = var.get_value()
        sharding = getattr(value, "sharding", None)
        shard_shape = sharding.shard_shape(value.shape) if sharding is not None else value.shape
        nbytes = int(np.prod(shard_shape)) * value.dtype.itemsize
        total_bytes += nbytes
        spec = getattr(sharding, "spec", "-")
        logical = ",".join(str(a) for a in logical_axes_of(var))
        rows.append((".".join(map(str, path)), str(tuple(value.shape)), logical, str(spec), f"{nbytes:,}"))
    n_params = sum(v.size for v in jax.tree.leaves(nnx.state(model, nnx.Param)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    mesh_txt = f" on mesh {dict(mesh.shape)}" if mesh is not None else ""
    lines.append(f"{n_params:,} parameters{mesh_txt}; {total_bytes / 2**20:,.1f} MiB per device")
    return "\n".join(lines)


def visualize_param(model: GPT2, path: str) -> None:
    """Prints `jax.debug.visualize_array_sharding` of one ≤2-D parameter, e.g. 'wte.embedding'."""
    flat = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    if path not in flat:
        raise ConfigError(f"log.show_sharding: no parameter {path!r}; parameters: {sorted(flat)}")
    value = flat[path].get_value()
    if value.ndim > 2:
        raise ConfigError(f"log.show_sharding: {path} is {value.ndim}-D; only 1-D and 2-D arrays can be drawn")
    jax.debug.visualize_array_sharding(value)
