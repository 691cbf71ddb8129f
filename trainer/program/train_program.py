"""The training program: the train state's layout, the optimizer, and the jitted train call that runs up to
K optimizer steps in one scan. It holds no arrays; `trainer/run/loop.py` drives it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import optim
from configs.base import Config
from gpt2.model import GPT2, next_token_loss
from gpt2.sharded_init import new_params
from gpt2.sharding import ShardingRules
from optim.base import all_finite
from optim.spike_guard import from_state_format_1
from trainer.program.ahead import Ahead
from trainer.program.evaluator import Evaluator
from trainer.program.layout import ModelLayout

# {"params": nnx.State, "opt_state": the optimizer's state (optim.build: the spike guard's statistics included),
#  "step": int32[], "rng": key}: the same structure whatever the config
TrainState = dict[str, Any]
STATE_FORMAT = 2  # recorded in every checkpoint's metadata; without it, a checkpoint from before the guard's
# statistics moved into the optimizer state (see `restore_target`)


@dataclasses.dataclass(frozen=True)
class TrainProgram:
    """Everything the jitted train call closes over: the model's layout, the optimizer and the state's
    shardings."""

    config: Config
    layout: ModelLayout  # the model's graph, mesh, rules and parameter shardings
    evaluator: Evaluator  # validation loss on the same layout (the loop's evaluations and its pre-save probe)
    optimizer: optim.Optimizer  # its transformation, and what it reports of each step
    state_shardings: TrainState  # NamedSharding per leaf
    batch_sharding: NamedSharding  # of a [K, B, T + 1] stack of batches
    # called on the host as each step of a call ends (its step number and loss), where a step takes long enough to
    # be worth it: on a CPU (a host callback inside the scan would make a GPU wait for the host). None: no callback
    on_step: Callable[[int, float], None] | None = None

    @classmethod
    def build(cls, config: Config, mesh: Mesh, on_step: Callable[[int, float], None] | None = None
              ) -> "TrainProgram":
        layout = ModelLayout.build(config.model, mesh, ShardingRules.preset(config.mesh.rules))
        optimizer = optim.build(config.optim, config.schedule, config.guard, config.train.steps,
                                config.model.mup_width_mult)
        tx = optimizer.tx
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
        return cls(config, layout, Evaluator.on(layout), optimizer, shardings, layout.batch_sharding(ndim=3),
                   on_step)

    @property
    def tx(self) -> optax.GradientTransformationExtraArgs:
        return self.optimizer.tx

    @property
    def mesh(self) -> Mesh:
        return self.layout.mesh

    @property
    def abstract_params(self) -> nnx.State:
        return self.layout.abstract_params

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs with shardings: the restore target, and the AOT compiler's input."""
        state = {
            "params": self.abstract_params,
            "opt_state": jax.eval_shape(self.tx.init, self.abstract_params),
            "step": jax.ShapeDtypeStruct((), jnp.int32),
            "rng": jax.eval_shape(lambda: jax.random.PRNGKey(0)),
        }
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state,
                            self.state_shardings)

    def restore_target(self, meta: dict) -> tuple[TrainState, Callable[[TrainState], TrainState]]:
        """(what to restore a checkpoint with this metadata into, how to make the restored tree a TrainState).

        Checkpoints written before STATE_FORMAT 2 keep the spike guard's statistics apart (optim/spike_guard.py)."""
        if meta.get("state_format") == STATE_FORMAT:
            return self.abstract_state(), lambda state: state
        had_guard = meta.get("config", {}).get("guard", {}).get("skip_spikes", False)
        return from_state_format_1(self.abstract_state(), had_guard, self.state_shardings["step"])

    def init_state(self, params: nnx.State | None = None) -> TrainState:
        """Fresh parameters (born sharded: the output shardings reach into the random-number generation, so each
        device makes only its own shard; gpt2/sharded_init.py), or the given ones (a fine-tune's starting
        weights), and a fresh optimizer state, step and key, in one program laid out as the train state."""
        config, rules, seed = self.config.model, self.layout.rules, self.config.train.seed

        def fresh(params):
            if params is None:
                params = new_params(config, rules, seed)
            return {"params": params, "opt_state": self.tx.init(params), "step": jnp.zeros((), jnp.int32),
                    "rng": jax.random.PRNGKey(seed)}

        with jax.set_mesh(self.mesh):
            return jax.jit(fresh, out_shardings=self.state_shardings)(params)

    def compile_ahead(self) -> Ahead:
        """The train call, compiling now on the background thread (trainer/program/ahead.py) while the host does
        the rest of the start-up: the run's first call waits only for what is left of it."""
        return Ahead(self.train_call(), self.mesh, *self.abstract_inputs())

    def model(self, params: nnx.State) -> GPT2:
        return self.layout.model(params)

    # ---- the jitted call ------------------------------------------------------------------------

    def train_call(self) -> Callable[[TrainState, jax.Array, jax.Array], tuple[TrainState, dict]]:
        """jit(state, batches [K, B, T+1], active [K] bool) -> (state, metrics).

        metrics: each [K]: whatever the step reports (`_train_step`: loss, grad_norm, and the optimizer's own
        report: each group's learning rate, the spike guard's skipped and streak); state_finite, bool[]: every
        parameter and optimizer moment is finite after the call (a state that is not must never be saved).

        Step i takes effect only where active[i]: a call that must end early (at an evaluation, a checkpoint or
        the last step) drops its tail instead of needing a second executable for fewer steps. An inactive step is
        computed and its result discarded by a select, not skipped by a `lax.cond`: XLA's GPU backend copies a
        conditional's predicate to the host and waits for it, which would make every call return only when its
        last step is done. The calls of a run whose evaluations and checkpoints fall on multiples of K have no
        inactive steps (trainer/run/loop.py `steps_this_call`); their metrics are the host's to drop.
        """

        def call(state, batches, active):
            def body(state, xs):
                batch, on = xs
                new, metrics = self._train_step(state, batch)
                if self.on_step is not None:
                    jax.debug.callback(self._step_ended, on, new["step"], metrics["loss"])
                return jax.tree.map(lambda n, o: jnp.where(on, n, o), new, state), metrics

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
        return self.train_call().lower(*self.abstract_inputs())

    def abstract_inputs(self) -> tuple[TrainState, jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
        """The train call's arguments as ShapeDtypeStructs: the state, the [K, B, T + 1] batches, the [K] mask."""
        t = self.config.train
        batches = jax.ShapeDtypeStruct((t.steps_per_call, t.batch_size, t.seq_len + 1), jnp.int32,
                                       sharding=self.batch_sharding)
        return self.abstract_state(), batches, jax.ShapeDtypeStruct((t.steps_per_call,), jnp.bool_)

    def _train_step(self, state: TrainState, batch: jax.Array) -> tuple[TrainState, dict]:
        """One optimizer step on a [B, T+1] batch, accumulating gradients over `grad_accum` micro-batches."""
        params, step, opt_state = state["params"], state["step"], state["opt_state"]
        dropout_key = jax.random.fold_in(state["rng"], step) if self.config.model.dropout > 0 else None
        loss, grads = self._grads(params, batch, dropout_key)
        grads = self._gradient_hook(grads, step)
        with jax.named_scope("optimizer"):
            updates, new_opt_state = self.tx.update(grads, opt_state, params, loss=loss)
            params = optax.apply_updates(params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
                   **self.optimizer.report(opt_state, new_opt_state)}
        new = {**state, "params": params, "opt_state": new_opt_state, "step": step + 1}
        return new, {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}

    def _step_ended(self, active, step, loss) -> None:
        if active:  # an inactive step's result is dropped: it is no step
            self.on_step(int(step), float(loss))

    def _gradient_hook(self, grads, step: jax.Array):
        """The identity. Tests replace it to plant a fault (a NaN gradient at a known step) in the real call."""
        return grads

    def _grads(self, params, batch, dropout_key):
        """(mean loss, mean gradients) over a [B, T+1] batch: in one pass, or accumulated over micro-batches."""
        if self.config.train.grad_accum == 1:
            return jax.value_and_grad(self._loss)(params, batch, dropout_key)
        return self._accumulated_grads(params, batch, dropout_key)

    def _accumulated_grads(self, params, batch, dropout_key):
        """Gradient accumulation in which each gradient is reduced across devices once per step.

        A scan that adds each micro-batch's gradient to a carry laid out as the parameters makes GSPMD reduce
        every micro-batch's gradient inside the loop (gpt2_124m on v5e:2x4: 27 all-reduces, 1.5 GiB per step
        per chip). Here the micro-batch is vmapped over S shards of its rows, `spmd_axis_name` pinning the
        shard axis to the batch's leading mesh axes over which no parameter is split (dp, tp: data and fsdp;
        fsdp, fsdp_tp: data), and the carry holds S partial sums, [S, ...] split over those axes: each shard
        adds up its own rows' gradients, and the sum over S after the scan is the step's one reduction. Inside
        the vmap the model runs with rules whose `batch` names only the remaining batch axes, so neither its
        activation constraints nor the splash kernel's shard_map name the shard axes. Parameters split over
        fsdp are all-gathered for every micro-batch anyway, and their gradients reduced over fsdp every
        micro-batch: deferring that would need full-size unreduced gradients on every device, undoing FSDP.
        (A shard_map manual over the shard axes does the same, but XLA's SPMD partitioner crashes on the
        cross-entropy's label gather under fsdp_tp in a partially manual region, and differentiating there by
        the parameters psums every micro-batch's gradient unless check_vma is off.)

        Dropout: micro-batch a of shard s draws its masks from the step's a-th key folded with s, so shards
        differ; the result is that of the same computation run shard by shard (tests/unit/test_train_step.py).
        """
        A, rules, mesh = self.config.train.grad_accum, self.layout.rules, self.mesh
        shard_axes = rules.replica_batch_axes()
        inner_axes = tuple(a for a in rules.mesh_axes("batch") or () if a not in shard_axes)
        S = _size(mesh, shard_axes)
        micro = _micro_batches(batch, A, _size(mesh, shard_axes + inner_axes), S)  # [A, S, b, T+1]
        micro = jax.lax.with_sharding_constraint(micro, PartitionSpec(None, shard_axes or None, inner_axes or None))
        keys = None  # [A, S]
        if dropout_key is not None:
            fold = jax.vmap(jax.vmap(jax.random.fold_in, (None, 0)), (0, None))
            keys = fold(jax.random.split(dropout_key, A), jnp.arange(S))
        local = ModelLayout.build(self.config.model, mesh, rules.with_batch(inner_axes))
        loss_fn = lambda p, b, k: next_token_loss(local.model(p), b, k)  # noqa: E731
        grad_fn = jax.vmap(jax.value_and_grad(loss_fn), (None, 0, 0), spmd_axis_name=shard_axes or None)
        loss, grads = self._sum_over_micro_batches(grad_fn, params, micro, keys, shard_axes)  # [S], [S, ...]
        return loss.sum() / (A * S), jax.tree.map(lambda g: g.sum(0) / (A * S), grads)

    def _sum_over_micro_batches(self, grad_fn, params, micro, keys, shard_axes):
        """Each shard's loss and gradients summed over the micro-batches: [S] and [S, ...], split over the shard
        axes like the rows and, along the others, like the parameters (under FSDP each device adds its part)."""
        S = micro.shape[1]
        specs = jax.tree.map(lambda s: PartitionSpec(shard_axes or None, *s.spec), self.layout.param_shardings)
        constrain = lambda c: (c[0], jax.lax.with_sharding_constraint(c[1], specs))  # noqa: E731

        def accumulate(carry, xs):
            return constrain(jax.tree.map(jnp.add, carry, grad_fn(params, *xs))), None

        zero = (jnp.zeros((S,), jnp.float32), jax.tree.map(lambda p: jnp.zeros((S, *p.shape), p.dtype), params))
        total, _ = jax.lax.scan(accumulate, constrain(zero), (micro, keys))
        return total

    def _loss(self, params, batch, dropout_key) -> jax.Array:
        return next_token_loss(self.model(params), batch, dropout_key)


def _micro_batches(batch: jax.Array, A: int, n: int, S: int) -> jax.Array:  # [B, T+1] -> [A, S, B/(A·S), T+1]
    """The batch's rows, split over n devices in contiguous runs, as A micro-batches of S shards (S divides n):
    micro-batch a takes the a-th of A slices of every device's rows, so no row leaves its device."""
    B, rest = batch.shape[0], batch.shape[1:]
    return batch.reshape(n, A, B // (n * A), *rest).swapaxes(0, 1).reshape(A, S, B // (A * S), *rest)


def _size(mesh: Mesh, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[a] for a in axes)
