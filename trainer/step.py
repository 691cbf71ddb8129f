"""The train state, the loss, and the jitted calls: K optimizer steps in one scan, and evaluation.

The model is kept as (graphdef, params): the jitted functions take the parameter pytree and rebuild the
module with `nnx.merge` at trace time only, so each call is a plain XLA executable over arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from configs.base import Config
from gpt2.model import GPT2
from gpt2.sharded import abstract_model, create_sharded_model
from gpt2.sharding import ShardingRules, batch_sharding, named_shardings
from trainer.optim import lr_schedule, make_optimizer

TrainState = dict[str, Any]  # {"params": nnx.State, "opt_state": optax state, "step": int32[], "rng": key}


@dataclasses.dataclass(frozen=True)
class Trainer:
    """The static parts of a run: everything the jitted calls close over."""

    config: Config
    mesh: Mesh
    rules: ShardingRules
    graphdef: nnx.GraphDef
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    state_shardings: TrainState  # NamedSharding per leaf
    abstract_params: nnx.State  # ShapeDtypeStructs with their shardings
    batch_sharding: NamedSharding  # of a [K, B, T + 1] stack of batches

    @classmethod
    def build(cls, config: Config, mesh: Mesh) -> "Trainer":
        rules = ShardingRules.preset(config.mesh.rules)
        tx = make_optimizer(config.optim, config.train.steps)
        graphdef, params = nnx.split(abstract_model(config.model, rules), nnx.Param)
        param_shardings = named_shardings(params, mesh, rules)
        replicated = NamedSharding(mesh, PartitionSpec())
        opt_shardings = optax.tree_map_params(
            tx, lambda _, s: s, jax.eval_shape(tx.init, params), param_shardings,
            transform_non_params=lambda _: replicated,
        )
        shardings = {"params": param_shardings, "opt_state": opt_shardings, "step": replicated,
                     "rng": replicated}
        abstract_params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                       params, param_shardings)
        return cls(config, mesh, rules, graphdef, tx, lr_schedule(config.optim, config.train.steps),
                   shardings, abstract_params, batch_sharding(mesh, rules, ndim=3))

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs with shardings: the restore target, and the AOT compiler's input."""
        state = {
            "params": self.abstract_params,
            "opt_state": jax.eval_shape(self.tx.init, self.abstract_params),
            "step": jax.ShapeDtypeStruct((), jnp.int32),
            "rng": jax.eval_shape(lambda: jax.random.PRNGKey(0)),
        }
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, self.state_shardings
        )

    def init_state(self) -> TrainState:
        """Fresh parameters (born sharded) and an optimizer state with the same layout."""
        model = create_sharded_model(self.config.model, self.mesh, self.rules, seed=self.config.train.seed)
        params = nnx.state(model, nnx.Param)
        opt_state = jax.jit(self.tx.init, out_shardings=self.state_shardings["opt_state"])(params)
        put = lambda x, s: jax.device_put(x, s)  # noqa: E731
        return {
            "params": params,
            "opt_state": opt_state,
            "step": put(jnp.zeros((), jnp.int32), self.state_shardings["step"]),
            "rng": put(jax.random.PRNGKey(self.config.train.seed), self.state_shardings["rng"]),
        }

    def model(self, params: nnx.State) -> GPT2:
        return nnx.merge(self.graphdef, params)

    # ---- jitted calls ---------------------------------------------------------------------------

    def train_call(self) -> Callable[[TrainState, jax.Array], tuple[TrainState, dict]]:
        """jit(state, batches [K, B, T+1]) -> (state after K steps, {loss, grad_norm, lr}: each [K])."""

        def call(state, batches):
            return jax.lax.scan(self._train_step, state, batches)

        return jax.jit(
            call,
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, None),
            donate_argnums=0,  # the old state's buffers become the new state's
        )

    def eval_call(self) -> Callable[[nnx.State, jax.Array], jax.Array]:
        """jit(params, batch [B, T+1]) -> mean next-token loss."""

        def call(params, batch):
            return self._loss(params, batch, None)

        batch = batch_sharding(self.mesh, self.rules, ndim=2)
        return jax.jit(call, in_shardings=(self.state_shardings["params"], batch))

    def _train_step(self, state: TrainState, batch: jax.Array) -> tuple[TrainState, dict]:
        """One optimizer step on a [B, T+1] batch, accumulating gradients over `grad_accum` micro-batches."""
        params, step = state["params"], state["step"]
        dropout_key = jax.random.fold_in(state["rng"], step) if self.config.model.dropout > 0 else None
        loss, grads = self._grads(params, batch, dropout_key)
        with jax.named_scope("optimizer"):
            updates, opt_state = self.tx.update(grads, state["opt_state"], params)
            params = optax.apply_updates(params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": self.schedule(step)}
        return {**state, "params": params, "opt_state": opt_state, "step": step + 1}, metrics

    def _grads(self, params, batch, dropout_key):
        grad_fn = jax.value_and_grad(self._loss)
        A = self.config.train.grad_accum
        if A == 1:
            return grad_fn(params, batch, dropout_key)
        micro = batch.reshape(A, batch.shape[0] // A, *batch.shape[1:])  # [A, B/A, T+1]
        keys = jax.random.split(dropout_key, A) if dropout_key is not None else None

        def accumulate(carry, xs):
            loss, grads = grad_fn(params, *xs)
            return jax.tree.map(jnp.add, carry, (loss, grads)), None

        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (loss, grads), _ = jax.lax.scan(accumulate, zero, (micro, keys))
        return loss / A, jax.tree.map(lambda g: g / A, grads)

    def _loss(self, params, batch, dropout_key) -> jax.Array:
        x, y = batch[:, :-1], batch[:, 1:]  # [B, T] inputs and next-token targets
        logits = self.model(params)(x, dropout_key=dropout_key)  # [B, T, V]
        with jax.named_scope("loss"):
            # float32 log-softmax even when the matmuls ran in bfloat16
            losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
        return losses.mean()
