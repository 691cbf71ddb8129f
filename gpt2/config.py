"""GPT-2 model configuration: one frozen dataclass and its named presets."""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated, Literal

import jax
import jax.numpy as jnp

from fields import Checked, Field  # the one check of every config's bounds (no JAX)
from errors import ConfigError  # the application's one ConfigError (errors.py imports nothing)

GPT2_VOCAB_SIZE = 50257  # r50k_base BPE ranks + <|endoftext|>

RematPolicy = Literal["none", "full", "dots", "dots_no_batch"]
AttentionImpl = Literal["xla", "cudnn", "splash", "auto"]
DType = Literal["float32", "bfloat16", "float16"]
Parametrization = Literal["standard", "mup"]
# Compute dtypes a backend can run where it is not all of DType: XLA:CPU has no float16 dot that accumulates in
# float32, which jax.nn.dot_product_attention asks for (it failed inside the first train call).
COMPUTE_DTYPES = {"cpu": ("float32", "bfloat16")}


@dataclasses.dataclass(frozen=True)
class GPT2Config(Checked, section="model"):
    """Architecture of a GPT-2 model.

    Letter legend used in shape comments across `gpt2/`:
    B batch, T time, D embed (n_embd), H heads, K head dim, F mlp (4·D), V vocab, L layers.
    """

    vocab_size: Annotated[int, Field("real vocabulary; ids >= vocab_size never occur", gt=0)] = GPT2_VOCAB_SIZE
    pad_vocab_to: Annotated[int, Field(
        "round the vocabulary up to a multiple of this (128 keeps matmuls tile-aligned)", gt=0)] = 1
    block_size: Annotated[int, Field("maximum sequence length (rows of wpe)", gt=0)] = 1024
    n_layer: Annotated[int, Field("transformer blocks", gt=0)] = 12
    n_head: Annotated[int, Field("attention heads (must divide n_embd)", gt=0)] = 12
    n_embd: Annotated[int, Field("width D of the residual stream", gt=0)] = 768
    dropout: Annotated[float, Field("on the embeddings and each residual branch; 0 for pre-training", ge=0, lt=1)] = 0.0
    bias: Annotated[bool, Field("biases in every Linear and LayerNorm, as GPT-2 has")] = True
    layer_norm_epsilon: Annotated[float, Field("LayerNorm's epsilon (HF GPT2Config's default)", gt=0)] = 1e-5
    dtype: Annotated[DType, Field("compute dtype of matmuls and activations")] = "float32"
    param_dtype: Annotated[DType, Field(
        "storage dtype of parameters (and so of the optimizer state)")] = "float32"
    scan_layers: Annotated[bool, Field("stack the blocks on a leading `layers` axis and lax.scan over them")] = True
    remat: Annotated[RematPolicy, Field("what to keep from each block's forward for the backward pass")] = "none"
    attention: Annotated[AttentionImpl, Field(
        '"xla" / "cudnn": jax.nn.dot_product_attention\'s implementations; "splash": the TPU Pallas kernel'
        ' (gpt2/splash.py; interpreted, slowly, off TPU); "auto": the fast kernel of the platform traced for: splash'
        " on TPU, cuDNN's flash attention on a GPU that can run it (half precision; gpt2/cudnn.py), else XLA's"
        " (the start-up says which and why; see layers.attention_implementation)")] = "auto"
    attention_query_blocks: Annotated[int, Field(
        ">1: queries in this many blocks, each attending only to its key prefix, so the masked upper triangle is"
        " never computed (~37% less attention work at 4). For XLA:CPU, which has no fused causal attention",
        gt=0)] = 1
    # 512 is MaxText's default (sa_block_*); 128 is the TPU's lane width, by which the kernel tiles
    splash_block_q: Annotated[int, Field(
        "splash attention's query rows per block, in the forward pass and both backward kernels (shrunk to fit"
        " shorter sequences)", gt=0, multiple_of=128)] = 512
    splash_block_kv: Annotated[int, Field(
        "splash attention's key/value rows per block, as splash_block_q", gt=0, multiple_of=128)] = 512
    document_mask: Annotated[bool, Field(
        "attention stays inside a document: each <|endoftext|> in a row starts a new one (gpt2/model.py"
        " `documents`; the loader packs documents back to back). Splash takes them as segment ids; elsewhere a"
        " [B, 1, T, T] boolean mask is compared in the trace")] = False
    document_positions: Annotated[bool, Field(
        "with document_mask: positions restart at 0 at every <|endoftext|>, so a packed document is embedded as if"
        " it were alone (as at sampling time), but wpe rows past the typical document length are then rarely"
        " trained")] = False
    parametrization: Annotated[Parametrization, Field(
        '"mup": the Maximal Update Parametrization (Yang et al. 2022, "Tensor Programs V"; docs/mup.md), so that the'
        " best learning rate found at width mup_base_width holds at n_embd: relative to that width (m = n_embd /"
        " mup_base_width) the hidden matrices' init std × 1/√m and AdamW rate × 1/m, the logits × mup_output_mult/m,"
        ' attention scores × √K_base/K; "standard": GPT-2\'s own (Hugging Face parity)')] = "standard"
    mup_base_width: Annotated[int, Field(
        "with parametrization=mup: the tuned proxy's width, where every μP width multiplier is 1", gt=0)] = 128
    mup_input_mult: Annotated[float, Field(
        "with parametrization=mup: α_in, the embeddings' (wte + wpe) multiplier, tuned at the base width with the"
        " rate (Tensor Programs V's input multiplier; 10 in Cerebras-GPT, 30 on the CPU proxy: docs/mup.md)",
        gt=0)] = 1.0
    mup_output_mult: Annotated[float, Field(
        "with parametrization=mup: α_out, the readout's multiplier at the base width (the logits × α_out/m), tuned"
        " there with the rate (Tensor Programs V's output multiplier; 8 on the CPU proxy, docs/mup.md). At 1 the"
        " readout stays as cold as GPT-2's at the base width however wide the model grows", gt=0)] = 1.0
    mup_base_head_dim: Annotated[int | None, Field(
        "with parametrization=mup: the head dim at the base width, where the attention scale √K_base/K (Tensor"
        " Programs V's 1/K) is GPT-2's 1/√K. None: this model's own, so the scale is GPT-2's 1/√K, as it should be"
        " where the heads grow at a fixed head dim (GPT-2's sizes: 64)", gt=0)] = None
    mup_base_depth: Annotated[int | None, Field(
        "with parametrization=mup: the tuned proxy's n_layer, for depth transfer (CompleteP, Dey et al. 2025:"
        " each residual branch × mup_base_depth/n_layer, the residual projections initialized as at this depth, the"
        " rates unchanged). None: μP in width only, GPT-2's 0.02/√(2·n_layer) init of the residual projections", gt=0
    )] = None

    def cross_check(self) -> None:
        if self.n_embd % self.n_head:
            raise ConfigError(f"model.n_head={self.n_head} must divide model.n_embd={self.n_embd}")
        if self.document_positions and not self.document_mask:
            raise ConfigError("model.document_positions=true restarts positions at document boundaries and needs"
                              " model.document_mask=true")
        if self.parametrization == "standard":  # a μP field away from its default would do nothing there (the
            # base width excepted: every config has one, and checkpoints record it)
            for f in dataclasses.fields(self):
                value = getattr(self, f.name)
                if f.name.startswith("mup_") and f.name != "mup_base_width" and value != f.default:
                    raise ConfigError(f"model.{f.name}={value} applies only with model.parametrization=mup")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_to
        return (self.vocab_size + m - 1) // m * m

    # ---- μP (standard: every multiplier 1, the scale 1/√K) ------------------------------------------------
    # As the `mup` package assigns them (tests/unit/test_mup.py checks against it, parameter by parameter), in the
    # MuReadout form of Tensor Programs V's Table 8. A hidden matrix (both dimensions grow with the width: c_attn,
    # c_proj, c_fc: gpt2/layers.py `hidden_matrix`) is initialized with std × 1/√m and learns at 1/m of Adam's rate
    # (optim/adamw.py); wte, wpe, biases and norms keep their init and rate. The tied head: wte is also the readout,
    # as in mup's MuSharedReadout, whose weight keeps the embedding's init and rate while its input is multiplied by
    # α_out/m. α_in and α_out are the base width's own hyperparameters (1: GPT-2's); depth: CompleteP's rules.

    @property
    def width_mult(self) -> float:
        """μP's width multiplier m = n_embd / mup_base_width (1 under the standard parametrization)."""
        return self.n_embd / self.mup_base_width if self.parametrization == "mup" else 1.0

    @property
    def mup_width_mult(self) -> float | None:
        """m under μP, None under the standard parametrization: what the optimizer's per-parameter rates take."""
        return self.width_mult if self.parametrization == "mup" else None

    def hidden_init_std(self, std: float) -> float:
        """The init std of a hidden matrix whose standard std is `std`: variance ∝ 1/fan_in under μP."""
        return std / math.sqrt(self.width_mult)

    @property
    def residual_init_std(self) -> float:
        """GPT-2's init std of the residual projections (attn.c_proj, mlp.c_proj), 0.02/√(2L) (Radford et al. 2019,
        section 2.3), before μP's width rule; under depth scaling L is the base depth, the branch multiplier doing
        the rest."""
        return 0.02 / math.sqrt(2 * self.base_depth)

    @property
    def base_depth(self) -> int:
        """The depth where the residual branches' multiplier is 1: mup_base_depth under μP with depth scaling, else
        n_layer."""
        return self.mup_base_depth if self.parametrization == "mup" and self.mup_base_depth else self.n_layer

    @property
    def residual_multiplier(self) -> float:
        """What each residual branch's output is multiplied by: CompleteP's L_base/L (α = 1: Dey et al. 2025, Table 1,
        whose rates at α = 1 need no depth factor: η·(L/L_base)^(α−1)); 1 without depth scaling."""
        return self.base_depth / self.n_layer

    @property
    def input_multiplier(self) -> float:
        """What the embeddings (wte + wpe) are multiplied by: α_in under μP, 1 in the standard parametrization."""
        return self.mup_input_mult if self.parametrization == "mup" else 1.0

    @property
    def mup_summary(self) -> str:
        """μP's base and multipliers in a few words (the start-up's model line)."""
        base = [f"width {self.mup_base_width}"] + [f"head dim {self.mup_base_head_dim}"] * bool(self.mup_base_head_dim)
        base += [f"depth {self.mup_base_depth}"] * bool(self.mup_base_depth)
        return f"μP base {', '.join(base)}; α_in {self.mup_input_mult:g}, α_out {self.mup_output_mult:g}"

    @property
    def logit_multiplier(self) -> float:
        """What the readout's input (and so the logits) is multiplied by: MuReadout's α_out/m."""
        return (self.mup_output_mult if self.parametrization == "mup" else 1.0) / self.width_mult

    @property
    def attention_scale(self) -> float:
        """The softmax scale of q·k: 1/√K, or μP's 1/K (Tensor Programs V, section 4) × √K_base, which is 1/√K at the
        base width's head dim K_base."""
        if self.parametrization == "mup":
            return math.sqrt(self.mup_base_head_dim or self.head_dim) / self.head_dim
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def parameter_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    def num_params(self, *, include_embedding: bool = True) -> int:
        """Parameter count with the head tied to `wte` (GPT-2 counts wpe, nanoGPT does not)."""
        D, L, F, V = self.n_embd, self.n_layer, 4 * self.n_embd, self.padded_vocab_size
        b = int(self.bias)
        per_block = (
            2 * D * (1 + b)  # ln_1, ln_2
            + D * 3 * D + 3 * D * b  # attn.c_attn
            + D * D + D * b  # attn.c_proj
            + D * F + F * b + F * D + D * b  # mlp.c_fc, mlp.c_proj
        )
        total = L * per_block + D * (1 + b) + V * D + self.block_size * D
        if not include_embedding:
            total -= V * D + self.block_size * D
        return total

    def flops_per_token(self, seq_len: int | None = None, *, causal: bool = False) -> float:
        """Training FLOPs per token: 6·N (non-embedding matmuls + tied head) plus attention.

        PaLM appendix B / nanoGPT `estimate_mfu` (this project's MFU): 6N + 12·L·D·T (QKᵀ and AV, fwd + bwd, over
        every query-key pair). `causal`: only the pairs a causal mask keeps, 6N + 6·L·D·T (MaxText, llm.c).
        """
        T = seq_len or self.block_size
        n = self.num_params(include_embedding=False) + self.padded_vocab_size * self.n_embd
        return 6 * n + (6 if causal else 12) * self.n_layer * self.n_embd * T

    # ---- presets -------------------------------------------------------------------------------

    @classmethod
    def gpt2(cls, **kw) -> "GPT2Config":  # 124M
        return cls(**{**dict(n_layer=12, n_head=12, n_embd=768), **kw})

    @classmethod
    def gpt2_medium(cls, **kw) -> "GPT2Config":  # 350M
        return cls(**{**dict(n_layer=24, n_head=16, n_embd=1024), **kw})

    @classmethod
    def gpt2_large(cls, **kw) -> "GPT2Config":  # 774M
        return cls(**{**dict(n_layer=36, n_head=20, n_embd=1280), **kw})

    @classmethod
    def gpt2_xl(cls, **kw) -> "GPT2Config":  # 1558M
        return cls(**{**dict(n_layer=48, n_head=25, n_embd=1600), **kw})

    @classmethod
    def tiny(cls, **kw) -> "GPT2Config":  # CPU smoke shape (issue 6's benchmark shape)
        return cls(**{**dict(n_layer=4, n_head=4, n_embd=128, block_size=256), **kw})

    @classmethod
    def nano(cls, **kw) -> "GPT2Config":  # unit tests: small vocab, two layers
        return cls(**{**dict(vocab_size=96, n_layer=2, n_head=2, n_embd=32, block_size=16), **kw})

    @classmethod
    def preset(cls, name: str, **kw) -> "GPT2Config":
        try:
            factory = PRESETS[name]
        except KeyError:
            raise ConfigError(
                f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}"
            ) from None
        return factory(**kw)


PRESETS = {
    "gpt2": GPT2Config.gpt2,
    "gpt2-medium": GPT2Config.gpt2_medium,
    "gpt2-large": GPT2Config.gpt2_large,
    "gpt2-xl": GPT2Config.gpt2_xl,
    "tiny": GPT2Config.tiny,
    "nano": GPT2Config.nano,
}


def check_compute_dtype(config: GPT2Config, platform: str) -> None:
    """Refuses a compute dtype the backend (`jax.default_backend()`) cannot run, naming the ones it can."""
    supported = COMPUTE_DTYPES.get(platform, DType.__args__)
    if config.dtype not in supported:
        raise ConfigError(f"model.dtype={config.dtype} is not supported on {platform}; use one of {list(supported)}")


# The name of q, k and v as the attention reads them (their bias added; for the splash kernel heads-first, scaled and
# padded to whole 128-token blocks), given where they are made (gpt2/layers.py, gpt2/splash.py). remat="dots" keeps
# them beside the matmuls' outputs, so the backward does not redo the bias add or the splash kernel's transposes;
# they replace the projection's bare output among what is kept (gpt2_xl_pod: docs/aot_planning.md, "Chosen, and
# why"). Not the `qkv` parameter axis of gpt2/sharding.py: this names activations for jax.checkpoint.
QKV = "qkv"


def remat_policy(name: RematPolicy):
    """Named `jax.checkpoint` policies (None means: do not rematerialize)."""
    return {
        "none": None,
        "full": jax.checkpoint_policies.nothing_saveable,
        "dots": jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.checkpoint_dots, jax.checkpoint_policies.save_only_these_names(QKV)),
        "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    }[name]
