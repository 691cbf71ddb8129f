"""A model's layout on a mesh: its graph, the rules that place its parameters, their shardings, and abstract
parameters. Holds no arrays; training, evaluation, restoring and importing weights all start from one.

The model is kept as (graphdef, params): jitted functions take the parameter pytree and rebuild the module with
`nnx.merge` at trace time only, so each call is a plain XLA executable over arrays.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from gpt2.config import GPT2Config
from gpt2.model import GPT2
from gpt2.sharded_init import abstract_model
from gpt2.sharding import ShardingRules, batch_sharding, named_shardings


@dataclasses.dataclass(frozen=True)
class ModelLayout:
    model_config: GPT2Config
    mesh: Mesh
    rules: ShardingRules
    graphdef: nnx.GraphDef
    param_shardings: nnx.State  # a NamedSharding per parameter
    abstract_params: nnx.State  # ShapeDtypeStructs with those shardings: the restore target

    @classmethod
    def build(cls, model_config: GPT2Config, mesh: Mesh, rules: ShardingRules) -> "ModelLayout":
        graphdef, params = nnx.split(abstract_model(model_config, rules), nnx.Param)
        shardings = named_shardings(params, mesh, rules)
        abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params, shardings)
        return cls(model_config, mesh, rules, graphdef, shardings, abstract)

    def model(self, params: nnx.State) -> GPT2:
        return nnx.merge(self.graphdef, params)

    def batch_sharding(self, ndim: int) -> NamedSharding:
        """Of a batch of token rows: [B, T+1] (ndim 2) or a stack of them [K, B, T+1] (ndim 3)."""
        return batch_sharding(self.mesh, self.rules, ndim=ndim)
