"""μP (model.parametrization=mup): what it assigns equals the reference `mup` package's, parameter by parameter
(init std, Adam's rate, weight decay, the readout, input and attention multipliers, two optimizer steps); Muon's
hidden matrices are scaled as Keller Jordan's Muon scales them; at its base width (any head dim) and depth μP is the
standard model; the coordinate check passes μP and fails each known mistake; the parametrization is recorded and
checked; HF weights and export refuse it; the pod preset takes its rates from the CPU proxy.

The reference checks need PyTorch (the `hf` extra) and `mup` 1.0.0, which `make test` installs without its
dependencies (its torchvision breaks transformers' import): they skip without PyTorch, and fail, saying how to
install it, where PyTorch is installed but `mup` is not. The other checks need neither."""

import dataclasses
import importlib
import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
import optim.adamw
from configs.base import Config, TrainConfig
from optim import unguarded
from optim.adamw import AdamWConfig, mup_lr_multipliers
from optim.base import by_path, is_hidden_matrix
from optim.muon import MuonConfig
from optim.schedules import CosineSchedule
from errors import ConfigError
from gpt2.config import GPT2Config
from gpt2.model import GPT2
from trainer.storage.checkpoints import CheckpointMismatch, check_compatible

DOCS = Path(__file__).parents[2] / "docs"

# m = 4: every μP width multiplier differs from the standard one by at least 2×; head dim 64 at the base width, 128
# at WIDE (2 heads), so the attention scale √64/128 differs from GPT-2's 1/√128; α_in and α_out not 1
BASE = GPT2Config(vocab_size=64, block_size=16, n_layer=2, n_head=1, n_embd=64, scan_layers=False,
                  parametrization="mup", mup_base_width=64)
WIDE = dataclasses.replace(BASE, n_embd=256, n_head=2, mup_base_head_dim=64, mup_input_mult=3.0, mup_output_mult=2.0)
CONSTANT = CosineSchedule(warmup_steps=0, min_lr_ratio=1.0)


@pytest.fixture(scope="module")
def wide() -> GPT2:
    return GPT2(WIDE, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def ref():
    """The reference μP (PyTorch's `mup`) and a GPT-2 built on it: (torch, mup, reference(config) -> model)."""
    torch = pytest.importorskip("torch", reason="the reference implementations are PyTorch's (the `hf` extra)")
    try:
        mup = importlib.import_module("mup")
    except ImportError:
        pytest.fail("the reference μP is not installed: `make test` installs it, or"
                    " pip install --no-deps mup==1.0.0 (the Makefile says why without its dependencies)")
    return torch, mup, _reference_model(torch, mup)


def random_like(params, seed: int):
    """Standard-normal arrays shaped as `params` (NumPy's: no per-shape JAX compilation)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: rng.standard_normal(x.shape, dtype=np.float32), params)


def flat(state) -> dict[tuple, np.ndarray]:
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(state)}


def _reference_model(torch, mup):
    """reference(c): the μP reference at c's width, a GPT-2 of torch.nn layers with our parameter names and
    MuSharedReadout tied to wte: set_base_shapes against the base width (and twice it, naming the width dimensions),
    then mutransformers' `_init_weights` (mup.init.normal_ for matrices, GPT-2's 1/√(2L) for c_proj)."""
    nn = torch.nn

    class TorchBlock(nn.Module):
        def __init__(self, c: GPT2Config):
            super().__init__()
            D = c.n_embd
            self.ln_1, self.ln_2 = nn.LayerNorm(D, eps=c.layer_norm_epsilon), nn.LayerNorm(D, eps=c.layer_norm_epsilon)
            self.attn = nn.Module()
            self.attn.c_attn, self.attn.c_proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
            self.mlp = nn.Module()
            self.mlp.c_fc, self.mlp.c_proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
            self.n_head = c.n_head
            self.attn_mult = math.sqrt(c.mup_base_head_dim or D // c.n_head)

        def forward(self, x):
            B, T, D = x.shape
            q, k, v = self.attn.c_attn(self.ln_1(x)).split(D, dim=-1)
            q, k, v = (a.view(B, T, self.n_head, D // self.n_head).transpose(1, 2) for a in (q, k, v))
            # mutransformers' GPT2Attention: scores × attn_mult / d_head
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                           scale=self.attn_mult / (D // self.n_head))
            x = x + self.attn.c_proj(y.transpose(1, 2).reshape(B, T, D))
            return x + self.mlp.c_proj(nn.functional.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh"))

    class TorchGPT2(nn.Module):
        def __init__(self, c: GPT2Config):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(c.vocab_size, c.n_embd), nn.Embedding(c.block_size, c.n_embd)
            self.h = nn.ModuleList(TorchBlock(c) for _ in range(c.n_layer))
            self.ln_f = nn.LayerNorm(c.n_embd, eps=c.layer_norm_epsilon)
            self.input_mult = c.mup_input_mult  # mutransformers' / Cerebras' embedding multiplier
            self.lm_head = mup.MuSharedReadout(self.wte.weight, bias=False, output_mult=c.mup_output_mult)

        def forward(self, idx):
            x = (self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))) * self.input_mult
            for block in self.h:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    def reference(c: GPT2Config) -> TorchGPT2:
        torch.manual_seed(0)
        at = lambda width: TorchGPT2(dataclasses.replace(c, n_embd=width))  # noqa: E731
        model = mup.set_base_shapes(TorchGPT2(c), at(c.mup_base_width), delta=at(2 * c.mup_base_width))
        with torch.no_grad():
            for name, module in model.named_modules():
                if isinstance(module, nn.Embedding):
                    module.weight.normal_(0.0, 0.02)
                elif isinstance(module, nn.LayerNorm):
                    module.weight.fill_(1.0), module.bias.zero_()
                elif isinstance(module, nn.Linear) and not isinstance(module, mup.MuReadout):
                    std = 0.02 / math.sqrt(2 * c.n_layer) if name.endswith("c_proj") else 0.02
                    mup.init.normal_(module.weight, std=std)
                    module.bias.zero_()
        return model

    return reference


def torch_name(path: tuple) -> str:
    name = ".".join(str(p) for p in path)
    return name.replace(".scale", ".weight").replace(".kernel", ".weight").replace(".embedding", ".weight")


def to_torch_layout(path: tuple, x: np.ndarray) -> np.ndarray:
    """Our array as the reference's: kernels [in..., out...] -> nn.Linear's [out, in]; c_attn's [3, H, K] flat."""
    if path[-1] == "kernel":
        fan_in = x.shape[0] if path[-2] != "c_proj" or path[-3] != "attn" else x.shape[0] * x.shape[1]
        return x.reshape(fan_in, -1).T
    return x.reshape(-1) if path[-2:] == ("c_attn", "bias") else x


def torch_params(model) -> dict:
    return dict(model.named_parameters())  # the tied head is wte.weight, listed once


def copy_into(torch, model, params) -> None:
    """Our parameters into the reference model."""
    with torch.no_grad():
        for path, value in flat(params).items():
            torch_params(model)[torch_name(path)].copy_(torch.from_numpy(to_torch_layout(path, value).copy()))


def test_init_stds_rate_multipliers_and_readout_equal_the_mup_packages(wide, ref):
    torch, mup, reference = ref
    ours = flat(nnx.state(wide, nnx.Param))
    theirs = torch_params(model := reference(WIDE))
    assert {torch_name(p) for p in ours} == set(theirs)
    multipliers = flat(mup_lr_multipliers(nnx.state(wide, nnx.Param), WIDE.width_mult))
    groups = mup.MuAdamW(theirs.values(), lr=1.0).param_groups  # lr 1: a group's lr is the multiplier
    rate = {id(p): g["lr"] for g in groups for p in g["params"]}
    for path, value in ours.items():
        p = theirs[torch_name(path)]
        assert multipliers[path] == pytest.approx(rate[id(p)], rel=1e-12), path
        assert value.size == p.numel()
        expected = p.detach().std().item()
        if expected == 0.0 or path[-1] == "scale":  # biases 0 and norm scales 1, exactly, on both sides
            np.testing.assert_array_equal(to_torch_layout(path, value), p.detach().numpy(), err_msg=str(path))
        else:  # independent draws: ≥ 4,096 samples each, so 6 % is > 4 standard errors; μP's changes are ≥ 2×
            assert value.std() == pytest.approx(expected, rel=0.06), path
    # the hidden matrices, as mup sees them: both dimensions grow with width (matrix-like), rate 1/m
    hidden = {path for path, v in nnx.to_flat_state(nnx.state(wide, nnx.Param)) if is_hidden_matrix(v)}
    assert {torch_name(p) for p in hidden} == {n for n, p in theirs.items() if p.infshape.ninf() == 2}
    assert {float(multipliers[p]) for p in hidden} == {0.25}
    assert {float(multipliers[p]) for p in ours if p not in hidden} == {1.0}
    assert model.lm_head.width_mult() == 4.0 and model.lm_head.output_mult / 4.0 == WIDE.logit_multiplier == 0.5


def test_forward_pass_equals_the_references_with_our_weights(wide, ref):
    """Our logits = the reference's (the embeddings × α_in, MuSharedReadout's α_out/width_mult, attention
    attn_mult / d_head with attn_mult = √(base head dim)) with our weights copied in: the multipliers sit where
    mup and mutransformers put them."""
    torch, _, reference = ref
    model = reference(WIDE)
    copy_into(torch, model, nnx.state(wide, nnx.Param))
    idx = np.random.default_rng(0).integers(0, WIDE.vocab_size, (2, WIDE.block_size))
    expected = model(torch.from_numpy(idx)).detach().numpy()
    got = np.asarray(wide(jnp.asarray(idx)))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    assert np.abs(expected).max() > 1e-2  # not trivially small logits
    assert WIDE.attention_scale == 8 / 128 != 1 / math.sqrt(128)


def test_two_adamw_steps_equal_mup_muadamw_parameter_by_parameter(wide, ref):
    """The same weights and gradients through our AdamW (μP) and mup.MuAdamW (decay on matrices and
    embeddings only, as ours): the parameters after two steps agree, so each parameter's rate and decoupled
    weight decay are MuAdamW's (rate / m, decay × m)."""
    torch, mup, reference = ref
    cfg = AdamWConfig(lr=3e-3, weight_decay=0.1, grad_clip=0.0)
    params = nnx.state(wide, nnx.Param)
    tx = unguarded(cfg, CONSTANT, 10, WIDE.mup_width_mult)
    opt_state, update = tx.init(params), jax.jit(tx.update)
    model = reference(WIDE)
    copy_into(torch, model, params)
    theirs, ours = torch_params(model), flat(params)
    decayed = [p for n, p in theirs.items() if n.endswith("weight") and p.dim() == 2]
    others = [p for n, p in theirs.items() if not (n.endswith("weight") and p.dim() == 2)]
    opt = mup.MuAdamW([{"params": decayed}, {"params": others, "weight_decay": 0.0}], lr=cfg.lr,
                      betas=(cfg.b1, cfg.b2), eps=cfg.eps, weight_decay=cfg.weight_decay)
    for seed in range(2):
        grads = random_like(params, seed)
        for path, g in flat(grads).items():
            theirs[torch_name(path)].grad = torch.from_numpy(to_torch_layout(path, g).copy())
        opt.step()
        updates, opt_state = update(grads, opt_state, params)
        params = jax.tree.map(np.add, params, updates)
    for path, value in flat(params).items():
        np.testing.assert_allclose(to_torch_layout(path, value), theirs[torch_name(path)].detach().numpy(),
                                   rtol=0, atol=2e-7, err_msg=str(path))
    moved = {p: np.abs(flat(params)[p] - ours[p]).max() for p in ours}
    assert moved[("h", 0, "mlp", "c_fc", "kernel")] == pytest.approx(moved[("wte", "embedding")] / 4, rel=0.05)


def test_muon_scales_each_hidden_matrix_as_keller_jordans_muon(wide, ref):
    """One Muon step on each hidden matrix equals Keller Jordan's `muon_update` (the `muon-optimizer` package)
    on the same gradient laid out as torch's [out, in] (q, k and v as three matrices): its
    max(1, fan_out/fan_in)^½ is 2 for c_fc (D -> 4D) and 1 for the others, and μP adds no 1/m to it."""
    torch = ref[0]
    muon_reference = pytest.importorskip("muon", reason="Keller Jordan's Muon (`muon-optimizer`) is a dev extra")
    cfg = MuonConfig(muon_lr=0.02, grad_clip=0.0)
    params = nnx.state(wide, nnx.Param)
    grads = random_like(params, 0)
    tx = unguarded(cfg, CONSTANT, 10, WIDE.mup_width_mult)
    hidden = {path for path, v in nnx.to_flat_state(params) if is_hidden_matrix(v)}
    updates = flat(jax.jit(tx.update)(grads, tx.init(params), params)[0])
    D = WIDE.n_embd
    for path, g in flat(grads).items():
        if path not in hidden:
            continue
        g = to_torch_layout(path, g)  # [out, in]; c_attn: q, k, v stacked as [3, D, D]
        g = g.reshape(3, D, D) if path[-2] == "c_attn" else g
        expected = -cfg.muon_lr * muon_reference.muon_update(torch.from_numpy(g.copy()), torch.zeros(g.shape),
                                                             beta=cfg.muon_momentum).float().numpy()
        got = to_torch_layout(path, updates[path]).reshape(expected.shape)
        scale = math.sqrt(max(1, g.shape[-2] / g.shape[-1]))
        assert scale == (2.0 if path[-2] == "c_fc" else 1.0)
        # the reference orthogonalizes in bfloat16 (~3 significant digits); its scale is √3 if qkv were one matrix
        assert np.linalg.norm(got) / np.linalg.norm(expected) == pytest.approx(1.0, abs=0.01), path
        assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 0.03, path


@pytest.mark.parametrize("n_head", [1, 4])
def test_at_the_base_width_and_depth_mup_is_the_standard_parametrization(n_head):
    """With α_in = α_out = 1, at the base width and depth, whatever the head dim (64, 16): the same init, logits and
    updates as the standard model (the attention scale √K_base/K is 1/√K there)."""
    mup = dataclasses.replace(BASE, n_head=n_head, mup_base_depth=BASE.n_layer)
    standard = dataclasses.replace(mup, parametrization="standard", mup_base_depth=None)
    a, b = GPT2(mup, rngs=nnx.Rngs(0)), GPT2(standard, rngs=nnx.Rngs(0))
    pa, pb = nnx.state(a, nnx.Param), nnx.state(b, nnx.Param)
    jax.tree.map(np.testing.assert_array_equal, pa, pb)
    idx = jnp.arange(16)[None] % BASE.vocab_size
    np.testing.assert_array_equal(a(idx), b(idx))
    cfg = AdamWConfig(grad_clip=0.0)
    grads = jax.tree.map(jnp.ones_like, pa)
    txs = (unguarded(cfg, CosineSchedule(warmup_steps=0), 10, m) for m in (mup.mup_width_mult, None))  # μP, standard
    ua, ub = (jax.jit(tx.update)(grads, tx.init(pa), pa)[0] for tx in txs)
    jax.tree.map(np.testing.assert_array_equal, ua, ub)
    assert mup.attention_scale == standard.attention_scale == 1 / math.sqrt(64 // n_head)
    assert (standard.width_mult, standard.logit_multiplier, standard.residual_multiplier) == (1.0, 1.0, 1.0)


def test_depth_scaling_multiplies_each_branch_and_keeps_the_base_depths_init():
    """CompleteP (α = 1): at 4× the base depth each residual branch is × 1/4 and the residual projections keep the
    base depth's 0.02/√(2·L_base) (× 1/√m), so the blocks' parameters are drawn as at the base depth; without it,
    GPT-2's 0.02/√(2L)."""
    deep = dataclasses.replace(WIDE, n_layer=8, mup_base_depth=2)
    assert deep.residual_multiplier == 0.25 and deep.residual_init_std == 0.02 / 2
    assert dataclasses.replace(deep, mup_base_depth=None).residual_init_std == 0.02 / 4
    model = GPT2(deep, rngs=nnx.Rngs(0))
    assert model.h[0].branch_scale == 0.25
    assert np.asarray(model.h[0].mlp.c_proj.kernel.get_value()).std() == pytest.approx(0.01 / 2, rel=0.05)


# ---- the coordinate check: it passes μP, and fails each mistake a μP implementation is known to make ----------

# the head dim grows with the width (2 heads), so that the attention scale shows; depth at twice the base width
COORD = dict(vocab_size=64, block_size=16, scan_layers=False, parametrization="mup", mup_base_width=32,
             mup_base_head_dim=16)
BY_WIDTH = {w: GPT2Config(n_layer=2, n_head=2, n_embd=w, **COORD) for w in (32, 256)}
BY_DEPTH = {n: GPT2Config(n_layer=n, n_head=4, n_embd=64, mup_base_depth=2, **COORD) for n in (2, 8)}


def _hidden_rate_not_divided(monkeypatch):
    monkeypatch.setattr(optim.adamw, "mup_lr_multipliers", lambda params, m: by_path(params, lambda path, v: 1.0))


def _every_rate_divided(monkeypatch):
    monkeypatch.setattr(optim.adamw, "mup_lr_multipliers", lambda params, m: by_path(params, lambda path, v: 1 / m))


def _attention_one_over_sqrt_k(monkeypatch):
    monkeypatch.setattr(GPT2Config, "attention_scale", property(lambda c: 1 / math.sqrt(c.head_dim)))


@pytest.mark.parametrize("models, mistake, breaks", [
    (BY_WIDTH, None, set()),
    (BY_WIDTH, _hidden_rate_not_divided, {"attn_logits", "attn", "mlp", "residual"}),
    (BY_WIDTH, _every_rate_divided, {"embedding"}),
    (BY_WIDTH, _attention_one_over_sqrt_k, {"attn_logits"}),
    ({w: dataclasses.replace(c, parametrization="standard", mup_base_head_dim=None) for w, c in BY_WIDTH.items()},
     None, {"attn_logits", "attn", "mlp", "residual"}),
    (BY_DEPTH, None, set()),
    ({n: dataclasses.replace(c, mup_base_depth=None) for n, c in BY_DEPTH.items()}, None, {"residual"}),
], ids=["mup by width", "hidden rate not ÷ m", "every rate ÷ m", "attention 1/√K", "standard",
        "mup by depth", "no depth scaling"])
def test_the_coordinate_check_passes_mup_and_fails_each_known_mistake(models, mistake, breaks, monkeypatch):
    """The change of every layer's output from its value at init (the attention logits' learned part Δq·Δk), after
    4 AdamW steps at 2e-2, averaged over 2 seeds, at 8× the width (32 → 256, head dim 16 → 128) or 4× the depth
    (2 → 8 layers at width 64): under μP every kind of layer moves as much at both sizes, within [1/4, 5/4] (what
    vanishes at finite size does so as 1/√size at most); each known mistake moves some kind out of it. By depth the
    attention logits are left out: averaged over other layers at each depth, they grow ×1.3–1.6 from 2 to 8 layers
    with or without depth scaling, which rules the residual stream. `python -m benchmarks.mup_transfer
    --coord_check` draws the same at more sizes (docs/mup.md)."""
    from benchmarks.mup_transfer import by_kind, coordinate_check

    if mistake:
        mistake(monkeypatch)
    tokens = np.random.default_rng(0).integers(0, 64, 4096)
    found = by_kind(coordinate_check(models, tokens=tokens, steps=4, lr=2e-2, seq=16))  # {kind: [sizes, steps]}
    ratio = {kind: float(v[-1, -1] / v[0, -1]) for kind, v in found.items()}
    if models[max(models)].n_layer != models[min(models)].n_layer:
        del ratio["attn_logits"]
    broken = {kind for kind, r in ratio.items() if not 1 / 4 <= r <= 5 / 4}
    assert (broken >= breaks if breaks else not broken), ratio


def test_the_coordinate_checks_forward_pass_is_the_models():
    from benchmarks.mup_transfer import layer_outputs

    model = GPT2(dataclasses.replace(BY_DEPTH[8], mup_input_mult=3.0, mup_output_mult=2.0), rngs=nnx.Rngs(0))
    idx = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 16)))
    np.testing.assert_allclose(layer_outputs(model, idx)["logits"], model(idx), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    (dict(parametrization="mu-p"), "--model.parametrization must be one of standard, mup, got 'mu-p'"),
    (dict(mup_base_width=0), "--model.mup_base_width must be an integer > 0, got 0"),
    (dict(parametrization="mup", mup_output_mult=0.0), "--model.mup_output_mult must be a finite number > 0, got 0.0"),
    (dict(parametrization="mup", mup_base_depth=0), "--model.mup_base_depth must be an integer > 0, got 0"),
    (dict(mup_output_mult=8.0), "model.mup_output_mult=8.0 applies only with model.parametrization=mup"),
    (dict(mup_base_depth=2), "model.mup_base_depth=2 applies only with model.parametrization=mup"),
])
def test_bad_mup_fields_name_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        GPT2Config.nano(**kwargs)


def test_init_from_hugging_face_weights_refuses_mup_in_one_line():
    with pytest.raises(ConfigError) as e:
        Config(init_from="hub:openai-community/gpt2", model=GPT2Config.nano(parametrization="mup"),
               train=TrainConfig(seq_len=16))
    assert str(e.value) == ("--init_from hub:openai-community/gpt2: Hugging Face GPT-2 weights are in the standard"
                            " parametrization; model.parametrization=mup would read them with μP's multipliers"
                            " (drop one of the two)")


def test_the_start_up_line_gives_the_hidden_matrices_rate_under_mup():
    """The logged `lr` is the rate of the parameters μP leaves at lr (embeddings, norms, biases): the start-up line
    says the hidden matrices' own; with Muon they are Muon's, at its own rate."""
    params = nnx.state(GPT2(GPT2Config.nano(parametrization="mup", mup_base_width=16), rngs=nnx.Rngs(0)), nnx.Param)
    line = AdamWConfig(lr=0.016).describe(params, 4.0)
    assert line.startswith("adamw (lr 0.016) on ")
    assert line.endswith(", its hidden matrices at lr/m = 0.004 (μP, m = 4)")
    assert "μP" not in AdamWConfig().describe(params) and "μP" not in MuonConfig().describe(params, 4.0)


def test_a_checkpoint_records_its_parametrization_and_another_is_refused():
    mup_run = Config(model=GPT2Config.nano(parametrization="mup", mup_base_width=16), train=TrainConfig(seq_len=16))
    saved = {"config": dataclasses.asdict(mup_run)}
    check_compatible(saved, mup_run, "ckpt")
    for change, message in ((dict(parametrization="standard"), "model.parametrization: checkpoint 'mup' vs config"
                                                              " 'standard'"),
                            (dict(mup_base_width=32), "model.mup_base_width: checkpoint 16 vs config 32"),
                            (dict(mup_input_mult=3.0), "model.mup_input_mult: checkpoint 1.0 vs config 3.0"),
                            (dict(mup_output_mult=8.0), "model.mup_output_mult: checkpoint 1.0 vs config 8.0"),
                            (dict(mup_base_head_dim=8), "model.mup_base_head_dim: checkpoint None vs config 8"),
                            (dict(mup_base_depth=1), "model.mup_base_depth: checkpoint None vs config 1")):
        other = dataclasses.replace(mup_run.model, **change)
        with pytest.raises(CheckpointMismatch, match=re.escape(message)):
            check_compatible(saved, dataclasses.replace(mup_run, model=other), "ckpt")
    # a checkpoint written before the field existed is a standard one
    standard = dataclasses.replace(mup_run, model=GPT2Config.nano())
    old = {"config": dataclasses.asdict(standard)}
    del old["config"]["model"]["parametrization"], old["config"]["model"]["mup_base_width"]
    check_compatible(old, standard, "ckpt")
    with pytest.raises(CheckpointMismatch, match="checkpoint 'standard'"):
        check_compatible(old, mup_run, "ckpt")


def test_the_mup_pod_preset_takes_its_rates_from_the_cpu_proxy():
    """gpt2_xl_pod_mup is gpt2_xl_pod in μP based at the sweep's proxy (width, head dim, depth), with the base part's
    α_in, α_out and rate as docs/mup/mup_transfer.json records them, and CompleteP's ε."""
    from benchmarks.mup_transfer import Proxy, transferred

    cfg, pod = configs.load("gpt2_xl_pod_mup"), configs.load("gpt2_xl_pod")
    swept = transferred(json.loads((DOCS / "mup/mup_transfer.json").read_text())["lines"])
    assert cfg.model == dataclasses.replace(
        pod.model, parametrization="mup", mup_base_width=Proxy.base_width, mup_base_head_dim=Proxy.head_dim,
        mup_base_depth=Proxy.n_layer, mup_input_mult=swept["mup_input_mult"], mup_output_mult=swept["mup_output_mult"])
    assert cfg.optim.lr == swept["lr"] and cfg.optim.eps == pytest.approx(1e-8 / (1600 / 32) / (48 / 2))
    assert cfg.train == pod.train and cfg.mesh == pod.mesh


def quoted_record(folder: str) -> dict:
    """A sweep's record (`<folder>/mup_transfer.json`), once its tables file and docs/mup.md are checked to hold what
    the benchmark's tables make of it."""
    from benchmarks.mup_transfer import tables

    record = json.loads((DOCS / folder / "mup_transfer.json").read_text())
    text = tables(record["lines"])
    assert (DOCS / folder / "mup_transfer.md").read_text() == text and text in (DOCS / "mup.md").read_text()
    assert len(record["proxy"]["seeds"]) >= 3 and all(len(r["val_loss"][0]) >= 3 for r in record["lines"])
    return record


def test_the_sweeps_tables_in_the_docs_are_those_of_its_record():
    """docs/mup/mup_transfer.md (and docs/mup.md, which quotes it) is what the benchmark's tables make of the runs
    docs/mup/mup_transfer.json records: every part, both optimizers, three seeds."""
    record = quoted_record("mup")
    assert {(r["part"], r["optimizer"]) for r in record["lines"]} == {("base", "adamw"), ("width", "adamw"),
                                                                       ("width", "muon"), ("depth", "adamw")}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_at_400_steps_mup_gets_better_with_every_doubling_of_width_for_every_seed(optimizer):
    """docs/mup/400_steps (quoted in docs/mup.md): the width part at 4× the steps. μP's best loss falls with every
    doubling for each seed, its best rate moves at most one 2× step from width to width, and it beats the standard
    parametrization's best at every width, paired."""
    from benchmarks.mup_transfer import best

    record = quoted_record("mup/400_steps")
    assert record["proxy"]["steps"] == 400
    by = {(r["parametrization"], r["width"]): r for r in record["lines"] if r["optimizer"] == optimizer}
    widths = sorted(w for p, w in by if p == "mup")
    assert widths[-1] >= 8 * widths[0]
    mup = [best(by["mup", w]) for w in widths]
    assert all((wide[1] < narrow[1]).all() for narrow, wide in zip(mup, mup[1:]))
    assert all(abs(wide[0] - narrow[0]) <= 1 for narrow, wide in zip(mup, mup[1:]))  # the grid's steps are 2×
    assert all((m[1] < best(by["standard", w])[1]).all() for m, w in zip(mup, widths))


def test_hugging_face_conversion_refuses_a_mup_model_in_one_line(tmp_path):
    pytest.importorskip("transformers")
    from gpt2.hf import HFCheckpointError, from_hf, to_hf

    model = GPT2(dataclasses.replace(BASE, n_embd=128), rngs=nnx.Rngs(0))
    with pytest.raises(HFCheckpointError, match="model.parametrization=mup; Hugging Face's GPT-2 has no μP"):
        to_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    to_hf(GPT2(dataclasses.replace(BASE, parametrization="standard"), rngs=nnx.Rngs(0)), tmp_path / "sp")
    with pytest.raises(HFCheckpointError, match="only standard models convert"):
        from_hf(tmp_path / "sp", parametrization="mup", mup_base_width=64)
