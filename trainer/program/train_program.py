"""The training program: the train state's layout, the optimizer, and the jitted train call that runs up to
K optimizer steps in one scan. It holds no arrays; `trainer/run/loop.py` drives it.
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
from gpt2.model import GPT2, next_token_loss
from gpt2.sharded_init import create_sharded_model
from gpt2.sharding import ShardingRules
from trainer.program.eval_call import Evaluator
from trainer.program.layout import ModelLayout
from trainer.program.optimizer import lr_schedule, make_optimizer
from trainer.program.spike_guard import all_finite, init_stats, is_outlier, update_stats

# {"params": nnx.State, "opt_state": optax state, "step": int32[], "rng": key, and with guard.skip_spikes
#  "guard": the spike guard's running statistics}
TrainState = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class TrainProgram:
    """Everything the jitted train call closes over: the model's layout, the optimizer and the state's
    shardings."""

    config: Config
    layout: ModelLayout  # the model's graph, mesh, rules and parameter shardings
    evaluator: Evaluator  # validation loss on the same layout (the loop's evaluations and its pre-save probe)
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    state_shardings: TrainState  # NamedSharding per leaf
    batch_sharding: NamedSharding  # of a [K, B, T + 1] stack of batches

    @classmethod
    def build(cls, config: Config, mesh: Mesh) -> "TrainProgram":
        layout = ModelLayout.build(config.model, mesh, ShardingRules.preset(config.mesh.rules))
        tx = make_optimizer(config.optim, config.train.steps)
        params, param_shardings = layout.abstract_params, layout.param_shardings
        replicated = NamedSharding(mesh, PartitionSpec())
        # every copy of the parameter tree in the optimizer state (moments, momenta) is laid out as the
        # parameters; the masked-out leaves of a partitioned optimizer (Muon + AdamW) stay masked
        masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
        opt_shardings = optax.tree_map_params(
            tx, lambda leaf, s: leaf if masked(leaf) else s, jax.eval_shape(tx.init, params), param_shardings,
            transform_non_params=lambda _: replicated, is_leaf=masked,
        )
        shardings = {"params": param_shardings, "opt_state": opt_shardings, "step": replicated,
                     "rng": replicated}
        if config.guard.skip_spikes:
            shardings["guard"] = jax.tree.map(lambda _: replicated, init_stats())
        return cls(config, layout, Evaluator.on(layout), tx, lr_schedule(config.optim, config.train.steps),
                   shardings, layout.batch_sharding(ndim=3))

    @property
    def mesh(self) -> Mesh:
        return self.layout.mesh

    @property
    def abstract_params(self) -> nnx.State:
        return self.layout.abstract_params

    def abstract_state(self, *, guard: bool | None = None) -> TrainState:
        """ShapeDtypeStructs with shardings: the restore target, and the AOT compiler's input. `guard`: with or
        without the spike guard's statistics (default: as configured; a checkpoint holds them if its run
        had the guard on)."""
        state = {
            "params": self.abstract_params,
            "opt_state": jax.eval_shape(self.tx.init, self.abstract_params),
            "step": jax.ShapeDtypeStruct((), jnp.int32),
            "rng": jax.eval_shape(lambda: jax.random.PRNGKey(0)),
        }
        shardings = dict(self.state_shardings)
        if self.guarded if guard is None else guard:
            state["guard"] = jax.eval_shape(init_stats)
            shardings["guard"] = jax.tree.map(lambda _: shardings["step"], state["guard"])
        shardings = {k: shardings[k] for k in state}
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)

    def with_guard_stats(self, state: TrainState) -> TrainState:
        """A state made to fit this run: fresh statistics (the guard warms up) for a new state or one restored
        from a run that had the guard off; none when this run has it off."""
        state = {k: v for k, v in state.items() if k != "guard" or self.guarded}
        if self.guarded and "guard" not in state:
            state["guard"] = jax.device_put(init_stats(), self.state_shardings["guard"])
        return state

    def init_state(self, params: nnx.State | None = None) -> TrainState:
        """Fresh parameters (born sharded), or the given ones in their shardings (a fine-tune's starting
        weights), and a fresh optimizer state with the same layout."""
        if params is None:
            model = create_sharded_model(self.config.model, self.mesh, self.layout.rules,
                                         seed=self.config.train.seed)
            params = nnx.state(model, nnx.Param)
        opt_state = jax.jit(self.tx.init, out_shardings=self.state_shardings["opt_state"])(params)
        put = lambda x, s: jax.device_put(x, s)  # noqa: E731
        state = {
            "params": params,
            "opt_state": opt_state,
            "step": put(jnp.zeros((), jnp.int32), self.state_shardings["step"]),
            "rng": put(jax.random.PRNGKey(self.config.train.seed), self.state_shardings["rng"]),
        }
        return self.with_guard_stats(state)

    @property
    def guarded(self) -> bool:
        return self.config.guard.skip_spikes

    def model(self, params: nnx.State) -> GPT2:
        return self.layout.model(params)

    # ---- the jitted call ------------------------------------------------------------------------

    def train_call(self) -> Callable[[TrainState, jax.Array, jax.Array], tuple[TrainState, dict]]:
        """jit(state, batches [K, B, T+1], active [K] bool) -> (state, metrics).

        metrics: loss, grad_norm, lr (and with the spike guard: skipped, streak), each [K]; state_finite,
        bool[]: every parameter and optimizer moment is finite after the call (a state that is not must never
        be saved).

        Step i runs only where active[i]: a call that must end early (at an evaluation, a checkpoint or the
        last step) skips its tail instead of needing a second executable for fewer steps. Inactive steps leave
        the state untouched and report zeros.
        """

        def call(state, batches, active):
            def body(state, xs):
                batch, on = xs
                return jax.lax.cond(on, self._train_step, self._inactive_step, state, batch)

            state, metrics = jax.lax.scan(body, state, (batches, active))
            finite = all_finite((state["params"], state["opt_state"]))
            return state, {**metrics, "state_finite": finite}

        return jax.jit(
            call,
            in_shardings=(self.state_shardings, self.batch_sharding, None),
            out_shardings=(self.state_shardings, None),
            donate_argnums=0,  # the old state's buffers become the new state's
        )

    def lower(self):
        """The train call lowered on abstract inputs (nothing allocated): for AOT reports and compile checks."""
        t = self.config.train
        batches = jax.ShapeDtypeStruct((t.steps_per_call, t.batch_size, t.seq_len + 1), jnp.int32,
                                       sharding=self.batch_sharding)
        active = jax.ShapeDtypeStruct((t.steps_per_call,), jnp.bool_)
        return self.train_call().lower(self.abstract_state(), batches, active)

    def _train_step(self, state: TrainState, batch: jax.Array) -> tuple[TrainState, dict]:
        """One optimizer step on a [B, T+1] batch, accumulating gradients over `grad_accum` micro-batches."""
        params, step = state["params"], state["step"]
        dropout_key = jax.random.fold_in(state["rng"], step) if self.config.model.dropout > 0 else None
        loss, grads = self._grads(params, batch, dropout_key)
        grads = self._gradient_hook(grads, step)
        with jax.named_scope("optimizer"):
            updates, opt_state = self.tx.update(grads, state["opt_state"], params)
            params = optax.apply_updates(params, updates)
        grad_norm = optax.tree.norm(grads)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": self.schedule(step)}
        new = {**state, "params": params, "opt_state": opt_state, "step": step + 1}
        if self.guarded:  # skipped updates did not advance the optimizer's own step count, nor its schedule
            metrics["lr"] = self.schedule(step - state["guard"]["skipped"])
            new, guard_metrics = self._guard(state, new, loss, grad_norm)
            metrics.update(guard_metrics)
        return new, {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}

    def _guard(self, old: TrainState, new: TrainState, loss, grad_norm) -> tuple[TrainState, dict]:
        """The spike guard's verdict on a step: `new`, or `old` with only the step counter and the statistics
        moved when the step is an outlier or not finite."""
        cfg, stats = self.config.guard, old["guard"]
        with jax.named_scope("spike_guard"):
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & all_finite((new["params"], new["opt_state"]))
            skip = ~finite | is_outlier(cfg, stats, loss, grad_norm)
            kept = jax.tree.map(lambda a, b: jnp.where(skip, a, b), (old["params"], old["opt_state"]),
                                (new["params"], new["opt_state"]))
            stats = update_stats(cfg, stats, loss, grad_norm, skip)
        state = {**new, "params": kept[0], "opt_state": kept[1], "guard": stats}
        return state, {"skipped": skip, "streak": stats["streak"]}

    def _inactive_step(self, state: TrainState, batch: jax.Array) -> tuple[TrainState, dict]:
        zero = jnp.zeros((), jnp.float32)
        names = ("loss", "grad_norm", "lr") + (("skipped", "streak") if self.guarded else ())
        return state, {k: zero for k in names}

    def _gradient_hook(self, grads, step: jax.Array):
        """The identity. Tests replace it to plant a fault (a NaN gradient at a known step) in the real call."""
        return grads

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
        return next_token_loss(self.model(params), batch, dropout_key)

