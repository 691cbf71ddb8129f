"""GPT-2 (Radford et al. 2019) in Flax NNX: token + position embeddings, n_layer pre-LN blocks, final
LayerNorm, and a language-model head tied to the token embedding.

Read top to bottom: `GPT2.__init__` builds the parameters, `GPT2.__call__` is the training forward pass,
`GPT2.decode` the KV-cached one used for sampling. The blocks live in `gpt2/layers.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gpt2.config import GPT2Config, remat_policy
from gpt2.layers import Block, KVCache, LayerNorm, normal, param_meta
from gpt2.sharding import ShardingRules

EOT = 50256  # <|endoftext|> (data/tokenizer.py): the loader writes one after every document


class GPT2(nnx.Module):
    """GPT-2 language model.

    Args:
      config: the architecture.
      rngs: parameter initialization randomness.
      rules: logical-axis rules used to constrain activations at block boundaries; None leaves XLA free
        (single device, or when the caller does not run under a mesh).
    """

    def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs, rules: ShardingRules | None = None):
        self.config = config
        self.rules = rules
        dtypes = dict(dtype=config.compute_dtype, param_dtype=config.parameter_dtype)
        self.wte = nnx.Embed(
            config.padded_vocab_size, config.n_embd, embedding_init=normal(0.02),
            embedding_metadata=param_meta("vocab", "embed"), rngs=rngs, **dtypes,
        )
        self.wpe = nnx.Embed(
            config.block_size, config.n_embd, embedding_init=normal(0.02),
            embedding_metadata=param_meta("positions", "embed"), rngs=rngs, **dtypes,
        )
        self.drop = nnx.Dropout(config.dropout)
        if config.scan_layers:
            self.h = _stacked_blocks(config, rngs, rules)  # one Block whose parameters are [L, ...]
        else:
            self.h = nnx.List([Block(config, rngs=rngs, rules=rules) for _ in range(config.n_layer)])
        self.ln_f = LayerNorm(config, rngs=rngs)

    def __call__(
        self,
        idx: jax.Array,  # [B, T] token ids
        *,
        dropout_key: jax.Array | None = None,  # None: deterministic (eval); a key: dropout on
    ) -> jax.Array:  # [B, T, V_padded] logits, padded ids at -inf-like
        k_embd, k_blocks = _split(dropout_key)
        segment_ids, positions = documents(idx) if self.config.document_mask else (None, None)
        if not self.config.document_positions:
            positions = None
        x = self._embed(idx, start=0, positions=positions, dropout_key=k_embd)
        x, _ = self._blocks(x, segment_ids=segment_ids, dropout_key=k_blocks)
        return self._head(x)

    def decode(
        self,
        idx: jax.Array,  # [B, T] new tokens (T = prompt length, then 1)
        cache: KVCache,  # (k, v), each [L, B, S, H, K]
        cache_index: jax.Array,  # scalar: position of idx[:, 0]
    ) -> tuple[jax.Array, KVCache]:  # ([B, T, V_padded], updated cache)
        # No document masking here: the prompt and what follows are one document (a prompt holding an
        # <|endoftext|> attends across it, as in HF's GPT-2), with positions counted from the prompt's start.
        x = self._embed(idx, start=cache_index)
        x, cache = self._blocks(x, cache=cache, cache_index=cache_index)
        return self._head(x), cache

    def init_cache(self, batch_size: int, max_len: int) -> KVCache:
        c = self.config
        shape = (c.n_layer, batch_size, max_len, c.n_head, c.head_dim)  # [L, B, S, H, K]
        return jnp.zeros(shape, c.compute_dtype), jnp.zeros(shape, c.compute_dtype)

    # ---- the three stages of the forward pass ----------------------------------------------

    def _embed(self, idx, *, start, positions=None, dropout_key=None) -> jax.Array:  # [B, T, D]
        x = self._token_embedding(idx) + self._position_embedding(idx.shape[1], start, positions)
        x = x * self.config.input_multiplier  # 1 (standard), or μP's α_in
        x = self.drop(x, deterministic=dropout_key is None, rngs=dropout_key)
        return self._constrain(x)

    def _token_embedding(self, idx) -> jax.Array:  # [B, T] -> [B, T, D]
        # All-gather the table's embed axis (FSDP) before the lookup, as for every other weight: a lookup
        # sharded on embed can reach batch-sharded activations only by replicating them whole (GSPMD's
        # "involuntary full rematerialization", e.g. on gpt2_xl_pod's data × fsdp mesh).
        cdt = self.config.compute_dtype
        table = self._constrain(self.wte.embedding[...].astype(cdt), ("vocab", None))  # [V, D]
        return jnp.take(table, idx, axis=0)

    def _position_embedding(self, T, start, positions) -> jax.Array:  # [1, T, D], or [B, T, D] for [B, T] positions
        cdt = self.config.compute_dtype
        if positions is None:  # start..start+T-1: a contiguous slice of wpe, no gather needed
            return jax.lax.dynamic_slice_in_dim(self.wpe.embedding[...], start, T).astype(cdt)[None]
        table = self._constrain(self.wpe.embedding[...].astype(cdt), ("positions", None))  # [T_max, D], as wte
        return jnp.take(table, positions, axis=0)

    def _blocks(self, x, *, segment_ids=None, cache: KVCache | None = None, cache_index=None, dropout_key=None):
        """Runs the L blocks: a lax.scan over stacked parameters, or a Python loop.

        Training passes a dropout key (or None), the [B, T] segment ids with document_mask (else None) and no
        cache; decoding passes the [L, B, S, H, K] cache and the position of x[:, 0]. Each block gets its own
        slice of the cache and its own dropout key; all share the segment ids.
        """
        L = self.config.n_layer
        keys = jax.random.split(dropout_key, L) if dropout_key is not None else None
        if self.config.scan_layers:
            graphdef, params = nnx.split(self.h)
            step = _block_fn(graphdef, self.config, self._constrain)

            def body(x, layer):  # layer: (params, cache slice, dropout key), each without the L axis
                x, layer_cache = step(x, *layer, cache_index, segment_ids)
                return x, layer_cache

            x, cache = jax.lax.scan(body, x, (params, cache, keys))
            return x, cache
        new_cache = []
        for i, block in enumerate(self.h):
            graphdef, params = nnx.split(block)
            step = _block_fn(graphdef, self.config, self._constrain)
            layer_cache = None if cache is None else (cache[0][i], cache[1][i])
            key = None if keys is None else keys[i]
            x, layer_cache = step(x, params, layer_cache, key, cache_index, segment_ids)
            new_cache.append(layer_cache)
        if cache is not None:
            cache = tuple(jnp.stack(c) for c in zip(*new_cache))
        return x, cache

    def _head(self, x) -> jax.Array:  # [B, T, D] -> [B, T, V_padded]
        c = self.config
        x = self.ln_f(x) * c.logit_multiplier  # 1 (standard), or μP's α_out/m: mup's MuSharedReadout multiplier
        logits = self.wte.attend(x)  # tied head: x @ wteᵀ
        if c.padded_vocab_size != c.vocab_size:  # padded ids must never be predicted
            valid = jnp.arange(c.padded_vocab_size) < c.vocab_size
            logits = jnp.where(valid, logits, jnp.finfo(logits.dtype).min)
        return self._constrain(logits, ("batch", "seq", "act_vocab"))

    def _constrain(self, x, logical=("batch", "seq", "act_embed")):
        """Pins a layout by logical axes: activations at block seams, the embedding table before its lookup
        (a no-op without rules or outside a mesh)."""
        if self.rules is None or jax.sharding.get_abstract_mesh().empty:
            return x
        return jax.lax.with_sharding_constraint(x, self.rules.spec(logical))


def next_token_loss(model: GPT2, batch: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
    """Mean cross-entropy of predicting batch[:, t + 1] from batch[:, :t + 1]; batch: [B, T + 1] token ids."""
    x, y = batch[:, :-1], batch[:, 1:]  # [B, T] inputs and next-token targets
    logits = model(x, dropout_key=dropout_key)  # [B, T, V]
    with jax.named_scope("loss"):
        losses = cross_entropy(logits, y)
    return losses.mean()


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:  # [..., V] float, [...] int -> [...] float32
    """Softmax cross-entropy computed in float32 even when the logits are bfloat16: optax's
    `softmax_cross_entropy_with_integer_labels` of `logits.astype(float32)`, with a backward of its own for
    low-precision logits.

    Differentiated through optax, the backward keeps a float32 softmax, a [B·T, V] array of 4-byte values written
    and read back. For bfloat16 logits `_narrow_cross_entropy` keeps the logits as they came (2 bytes each) and one
    log-normalizer per row instead, and recomputes the softmax in the one pass that writes the logits' gradient: on an
    H200 the loss's passes over the logits went from 2.8 to 1.8 ms of gpt2_124m's 26.5 ms step (docs/performance.md).
    Float32 logits keep optax's: there the softmax kept is no larger than the logits, and recomputing it costs an
    exponential per logit (on a CPU the loss and its gradient took 2.2x as long).
    """
    if logits.dtype == jnp.float32:
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return _narrow_cross_entropy(logits, labels)


@jax.custom_vjp
def _narrow_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return _narrow_cross_entropy_fwd(logits, labels)[0]


def _narrow_cross_entropy_fwd(logits, labels):  # [..., V], [...] -> [...] losses, residuals
    z = logits.astype(jnp.float32)
    log_normalizer = jax.nn.logsumexp(z, axis=-1)
    label_logit = jnp.take_along_axis(z, labels[..., None], axis=-1)[..., 0]
    return log_normalizer - label_logit, (logits, labels, log_normalizer)


def _narrow_cross_entropy_bwd(residuals, g):  # g: [...] -> the logits' gradient [..., V], none for the labels
    logits, labels, log_normalizer = residuals
    z = logits.astype(jnp.float32)
    softmax = jnp.exp(z - log_normalizer[..., None])
    is_label = labels[..., None] == jnp.arange(z.shape[-1])
    return ((softmax - is_label) * g[..., None]).astype(logits.dtype), None


_narrow_cross_entropy.defvjp(_narrow_cross_entropy_fwd, _narrow_cross_entropy_bwd)


def documents(idx: jax.Array) -> tuple[jax.Array, jax.Array]:  # [B, T] -> ([B, T], [B, T]) int32
    """Segment ids and within-document positions of packed rows: every <|endoftext|> starts a new document.

    The <|endoftext|> opens the document after it, as a beginning-of-text token (modded-nanogpt's
    `(inputs == 50256).cumsum()`; GPT-2 samples unconditionally from it): the next document's first token is then
    predicted from the <|endoftext|> alone, not from the document it closes, while predicting the <|endoftext|>
    itself (the target after a document's last token) still sees that whole document. A row's first, cut-off
    document is segment 0 with positions from the row's start.
    """
    is_eot = idx == EOT
    segment_ids = jnp.cumsum(is_eot, axis=1, dtype=jnp.int32)
    t = jnp.arange(idx.shape[1], dtype=jnp.int32)
    starts = jax.lax.cummax(jnp.where(is_eot, t, 0), axis=1)  # [B, T] where each token's document starts
    return segment_ids, t - starts


def _stacked_blocks(config: GPT2Config, rngs: nnx.Rngs, rules: ShardingRules | None) -> Block:
    """L blocks created by vmap: every parameter gains a leading `layers` axis (and logical name)."""

    @nnx.split_rngs(splits=config.n_layer)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs: nnx.Rngs) -> Block:
        return Block(config, rngs=rngs, rules=rules)

    return make(rngs)


def _block_fn(graphdef, config: GPT2Config, constrain):
    """A pure function (x, block params, cache, key, index, segment ids) -> (x, cache), rematerialized per
    config."""

    def apply(x, params, cache, key, cache_index, segment_ids):
        block = nnx.merge(graphdef, params)
        x, cache = block(x, segment_ids=segment_ids, cache=cache, cache_index=cache_index, dropout_key=key)
        return constrain(x), cache

    policy = remat_policy(config.remat)
    if config.remat == "none":
        return apply
    return jax.checkpoint(apply, policy=policy, prevent_cse=not config.scan_layers)


def _split(key):
    return jax.random.split(key) if key is not None else (None, None)
