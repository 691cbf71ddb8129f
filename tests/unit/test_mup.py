"""μP (model.parametrization=mup): what it assigns equals the reference `mup` package's, parameter by parameter
(init std, Adam's rate, weight decay, the readout and attention multipliers, two optimizer steps); Muon's hidden
matrices are scaled as Keller Jordan's Muon scales them; the coordinate check holds; at its base width μP is the
standard model; the parametrization is recorded and checked; HF weights and export refuse it; the pod preset
compiles for a TPU topology."""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from configs.base import Config, TrainConfig
from optim import unguarded
from optim.adamw import AdamWConfig, mup_lr_multipliers
from optim.base import is_hidden_matrix
from optim.muon import MuonConfig
from optim.schedules import CosineSchedule
from errors import ConfigError
from gpt2.config import MUP_ATTENTION_MULT, GPT2Config
from gpt2.model import GPT2
from trainer.storage.checkpoints import CheckpointMismatch, check_compatible

torch = pytest.importorskip("torch", reason="the reference implementations are PyTorch's (the `hf` extra)")
mup = pytest.importorskip("mup", reason="the reference μP (`mup` on PyPI) is a dev extra")

# m = 4: every μP multiplier differs from the standard one by at least 2×; head dim 64 at the base width
BASE = GPT2Config(vocab_size=64, block_size=16, n_layer=2, n_head=1, n_embd=64, scan_layers=False,
                  parametrization="mup", mup_base_width=64)
WIDE = dataclasses.replace(BASE, n_embd=256, n_head=2)
CONSTANT = CosineSchedule(warmup_steps=0, min_lr_ratio=1.0)


@pytest.fixture(scope="module")
def wide() -> GPT2:
    return GPT2(WIDE, rngs=nnx.Rngs(0))


def random_like(params, seed: int):
    """Standard-normal arrays shaped as `params` (NumPy's: no per-shape JAX compilation)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: rng.standard_normal(x.shape, dtype=np.float32), params)


def flat(state) -> dict[tuple, np.ndarray]:
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(state)}


class TorchBlock(torch.nn.Module):
    def __init__(self, c: GPT2Config):
        super().__init__()
        D, nn = c.n_embd, torch.nn
        self.ln_1, self.ln_2 = nn.LayerNorm(D, eps=c.layer_norm_epsilon), nn.LayerNorm(D, eps=c.layer_norm_epsilon)
        self.attn = nn.Module()
        self.attn.c_attn, self.attn.c_proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Module()
        self.mlp.c_fc, self.mlp.c_proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.n_head = c.n_head

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.attn.c_attn(self.ln_1(x)).split(D, dim=-1)
        q, k, v = (a.view(B, T, self.n_head, D // self.n_head).transpose(1, 2) for a in (q, k, v))
        # mutransformers' GPT2Attention: scores × attn_mult / d_head
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                             scale=MUP_ATTENTION_MULT / (D // self.n_head))
        x = x + self.attn.c_proj(y.transpose(1, 2).reshape(B, T, D))
        return x + self.mlp.c_proj(torch.nn.functional.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh"))


class TorchGPT2(torch.nn.Module):
    def __init__(self, c: GPT2Config):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(c.vocab_size, c.n_embd), torch.nn.Embedding(c.block_size, c.n_embd)
        self.h = torch.nn.ModuleList(TorchBlock(c) for _ in range(c.n_layer))
        self.ln_f = torch.nn.LayerNorm(c.n_embd, eps=c.layer_norm_epsilon)
        self.lm_head = mup.MuSharedReadout(self.wte.weight, bias=False)  # the head tied to wte

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def reference(c: GPT2Config) -> TorchGPT2:
    """The μP reference at c's width: set_base_shapes against the base width (and twice it, naming the width
    dimensions), then mutransformers' `_init_weights` (mup.init.normal_ for matrices, GPT-2's 1/√(2L) for c_proj)."""
    torch.manual_seed(0)
    at = lambda width: TorchGPT2(dataclasses.replace(c, n_embd=width))  # noqa: E731
    model = mup.set_base_shapes(TorchGPT2(c), at(c.mup_base_width), delta=at(2 * c.mup_base_width))
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Embedding):
                module.weight.normal_(0.0, 0.02)
            elif isinstance(module, torch.nn.LayerNorm):
                module.weight.fill_(1.0), module.bias.zero_()
            elif isinstance(module, torch.nn.Linear) and not isinstance(module, mup.MuReadout):
                std = 0.02 / math.sqrt(2 * c.n_layer) if name.endswith("c_proj") else 0.02
                mup.init.normal_(module.weight, std=std)
                module.bias.zero_()
    return model


def torch_name(path: tuple) -> str:
    name = ".".join(str(p) for p in path)
    return name.replace(".scale", ".weight").replace(".kernel", ".weight").replace(".embedding", ".weight")


def to_torch_layout(path: tuple, x: np.ndarray) -> np.ndarray:
    """Our array as the reference's: kernels [in..., out...] -> nn.Linear's [out, in]; c_attn's [3, H, K] flat."""
    if path[-1] == "kernel":
        fan_in = x.shape[0] if path[-2] != "c_proj" or path[-3] != "attn" else x.shape[0] * x.shape[1]
        return x.reshape(fan_in, -1).T
    return x.reshape(-1) if path[-2:] == ("c_attn", "bias") else x


def torch_params(model: TorchGPT2) -> dict[str, "torch.nn.Parameter"]:
    return dict(model.named_parameters())  # the tied head is wte.weight, listed once


def test_init_stds_rate_multipliers_and_readout_equal_the_mup_packages(wide):
    ours = flat(nnx.state(wide, nnx.Param))
    theirs = torch_params(ref := reference(WIDE))
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
    assert ref.lm_head.width_mult() == 4.0 == 1 / WIDE.logit_multiplier


def test_forward_pass_equals_the_references_with_our_weights(wide):
    """Our logits = the reference's (MuSharedReadout's 1/width_mult, attention attn_mult / d_head) with our
    weights copied in: the multipliers sit where mup puts them."""
    model = wide
    ref = reference(WIDE)
    with torch.no_grad():
        for path, value in flat(nnx.state(model, nnx.Param)).items():
            torch_params(ref)[torch_name(path)].copy_(torch.from_numpy(to_torch_layout(path, value).copy()))
    idx = np.random.default_rng(0).integers(0, WIDE.vocab_size, (2, WIDE.block_size))
    expected = ref(torch.from_numpy(idx)).detach().numpy()
    got = np.asarray(model(jnp.asarray(idx)))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    assert np.abs(expected).max() > 1e-2  # not trivially small logits


def test_two_adamw_steps_equal_mup_muadamw_parameter_by_parameter(wide):
    """The same weights and gradients through our AdamW (μP) and mup.MuAdamW (decay on matrices and
    embeddings only, as ours): the parameters after two steps agree, so each parameter's rate and decoupled
    weight decay are MuAdamW's (rate / m, decay × m)."""
    cfg = AdamWConfig(lr=3e-3, weight_decay=0.1, grad_clip=0.0)
    params = nnx.state(wide, nnx.Param)
    tx = unguarded(cfg, CONSTANT, 10, WIDE.mup_width_mult)
    opt_state, update = tx.init(params), jax.jit(tx.update)
    ref = reference(WIDE)
    theirs = torch_params(ref)
    ours = flat(params)
    with torch.no_grad():
        for path, value in ours.items():
            theirs[torch_name(path)].copy_(torch.from_numpy(to_torch_layout(path, value).copy()))
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


def test_muon_scales_each_hidden_matrix_as_keller_jordans_muon(wide):
    """One Muon step on each hidden matrix equals Keller Jordan's `muon_update` (the `muon-optimizer` package)
    on the same gradient laid out as torch's [out, in] (q, k and v as three matrices): its
    max(1, fan_out/fan_in)^½ is 2 for c_fc (D -> 4D) and 1 for the others, and μP adds no 1/m to it."""
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


def test_at_the_base_width_mup_is_the_standard_parametrization():
    """Head dim 64 at the base width: the same init, logits and updates as the standard model."""
    standard = dataclasses.replace(BASE, parametrization="standard")
    a, b = GPT2(BASE, rngs=nnx.Rngs(0)), GPT2(standard, rngs=nnx.Rngs(0))
    pa, pb = nnx.state(a, nnx.Param), nnx.state(b, nnx.Param)
    jax.tree.map(np.testing.assert_array_equal, pa, pb)
    idx = jnp.arange(16)[None] % BASE.vocab_size
    np.testing.assert_allclose(a(idx), b(idx), rtol=1e-6, atol=1e-6)
    cfg = AdamWConfig(grad_clip=0.0)
    grads = jax.tree.map(jnp.ones_like, pa)
    txs = (unguarded(cfg, CosineSchedule(warmup_steps=0), 10, m) for m in (BASE.mup_width_mult, None))  # μP, standard
    ua, ub = (jax.jit(tx.update)(grads, tx.init(pa), pa)[0] for tx in txs)
    jax.tree.map(np.testing.assert_array_equal, ua, ub)
    assert (standard.width_mult, standard.logit_multiplier, standard.attention_scale) == (1.0, 1.0, 1 / 8)
    assert dataclasses.replace(WIDE, parametrization="standard").hidden_init_std(0.02) == 0.02


def test_coordinate_check_flat_under_mup_growing_under_standard():
    """Mean |activation| of every layer's output over 3 steps (the first at init) of AdamW at 3e-3, at widths 64,
    256 and 1024 (2 layers of 4 heads, 256 ids, 4 × 32 tokens; μP based at 64). Under μP every layer stays within
    1.5× across the widths at every step, but the logits: they start at 1/√m of the base width's (μP's readout
    at init, variance 1/fan_in², Tensor Programs V's Table 3) and are within 2.5× once updated. Under the
    standard parametrization every block's output grows with the width, ≥ 10× from 64 to 1024 at every step.
    (`python -m benchmarks.mup_transfer --coord_check` draws widths 64 … 1024, docs/mup.md.)"""
    from benchmarks.mup_transfer import coordinate_check, layer_outputs

    tokens = np.random.default_rng(0).integers(0, 256, 4096)
    found = {p: _by_layer(coordinate_check(p, (64, 256, 1024), tokens=tokens, steps=3)) for p in ("mup", "standard")}
    for layer, per_width in found["mup"].items():  # [widths, steps]
        spread = per_width.max(axis=0) / per_width.min(axis=0)
        if layer == "logits":
            assert per_width[0, 0] / per_width[-1, 0] == pytest.approx(4.0, rel=0.1)  # √(1024 / 64)
            assert spread[1:].max() < 2.5, spread
        else:
            assert spread.max() < 1.5, (layer, spread)
    for layer, per_width in found["standard"].items():
        if layer.startswith("h"):
            assert (np.diff(per_width, axis=0) > 0).all() and (per_width[-1] / per_width[0]).min() > 10, layer
    # the check's forward pass, one branch at a time, is the model's
    model = GPT2(GPT2Config(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64, scan_layers=False),
                 rngs=nnx.Rngs(0))
    idx = jnp.asarray(tokens[:64].reshape(2, 32))
    np.testing.assert_allclose(layer_outputs(model, idx)["logits"], model(idx), rtol=1e-6, atol=1e-6)


def _by_layer(found: dict[int, dict[str, list]]) -> dict[str, np.ndarray]:  # {layer: [widths, steps]}
    widths = sorted(found)
    return {layer: np.array([found[w][layer] for w in widths]) for layer in found[widths[0]]}


@pytest.mark.parametrize("kwargs, message", [
    (dict(parametrization="mu-p"), "--model.parametrization must be one of standard, mup, got 'mu-p'"),
    (dict(mup_base_width=0), "--model.mup_base_width must be an integer > 0, got 0"),
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


def test_a_checkpoint_records_its_parametrization_and_another_is_refused():
    mup_run = Config(model=GPT2Config.nano(parametrization="mup", mup_base_width=16), train=TrainConfig(seq_len=16))
    saved = {"config": dataclasses.asdict(mup_run)}
    check_compatible(saved, mup_run, "ckpt")
    for other in (dataclasses.replace(mup_run.model, parametrization="standard"),
                  dataclasses.replace(mup_run.model, mup_base_width=32)):
        with pytest.raises(CheckpointMismatch, match="model.parametrization: checkpoint 'mup' "):
            check_compatible(saved, dataclasses.replace(mup_run, model=other), "ckpt")
    # a checkpoint written before the field existed is a standard one
    standard = dataclasses.replace(mup_run, model=GPT2Config.nano())
    old = {"config": dataclasses.asdict(standard)}
    del old["config"]["model"]["parametrization"], old["config"]["model"]["mup_base_width"]
    check_compatible(old, standard, "ckpt")
    with pytest.raises(CheckpointMismatch, match="checkpoint 'standard'"):
        check_compatible(old, mup_run, "ckpt")


def test_the_mup_pod_preset_takes_its_rate_from_the_cpu_sweep():
    cfg, pod = configs.load("gpt2_xl_pod_mup"), configs.load("gpt2_xl_pod")
    assert cfg.model.parametrization == "mup" and cfg.model == dataclasses.replace(
        pod.model, parametrization="mup", mup_base_width=cfg.model.mup_base_width)
    assert cfg.train == pod.train and cfg.mesh == pod.mesh


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
