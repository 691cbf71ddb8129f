"""The model: exact numbers on hand-set weights, and equivalences (scan/loop, remat, sharded, HF, KV cache)."""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gpt2 import GPT2, GPT2Config, create_sharded_model, param_report
from trainer.program.mesh import make_mesh
from gpt2.generate import generate
from gpt2.layers import CausalSelfAttention
from gpt2.model import cross_entropy, next_token_loss
from gpt2.sharding import RULES, ShardingRules, logical_axes_of

NANO = GPT2Config.nano()
TOKENS = jnp.asarray(np.random.RandomState(0).randint(0, NANO.vocab_size, (4, 12)), jnp.int32)


def loss_and_grads(model: GPT2, tokens=TOKENS):
    graphdef, params = nnx.split(model)

    def loss(params):
        logits = nnx.merge(graphdef, params)(tokens[:, :-1])
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean(), logits

    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return logits, value, grads


def flat(state) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


# ---- exact numbers -----------------------------------------------------------------------------


def test_attention_averages_only_the_past():
    """q = k = 0 makes every allowed position equally weighted; v = c_proj = identity exposes the mask."""
    c = GPT2Config(vocab_size=8, block_size=8, n_layer=1, n_head=1, n_embd=4)
    attn = CausalSelfAttention(c, rngs=nnx.Rngs(0))
    kernel = np.zeros((4, 3, 1, 4), np.float32)
    kernel[:, 2, 0, :] = np.eye(4)  # v = x
    attn.c_attn.kernel.set_value(jnp.asarray(kernel))
    attn.c_attn.bias.set_value(jnp.zeros((3, 1, 4)))
    attn.c_proj.kernel.set_value(jnp.eye(4).reshape(1, 4, 4))
    attn.c_proj.bias.set_value(jnp.zeros(4))
    x = jnp.asarray(np.arange(24, dtype=np.float32).reshape(1, 6, 4))
    y, _ = attn(x)
    expected = np.cumsum(np.asarray(x[0]), axis=0) / np.arange(1, 7)[:, None]  # mean over s <= t
    np.testing.assert_allclose(np.asarray(y[0]), expected, rtol=0, atol=1e-5)


def test_a_token_never_sees_the_future():
    model = GPT2(NANO, rngs=nnx.Rngs(0))
    changed = TOKENS.at[:, 7:].set((TOKENS[:, 7:] + 1) % NANO.vocab_size)
    a, b = model(TOKENS), model(changed)
    np.testing.assert_array_equal(np.asarray(a[:, :7]), np.asarray(b[:, :7]))
    assert not np.allclose(np.asarray(a[:, 7:]), np.asarray(b[:, 7:]))


def test_head_is_tied_to_wte_and_masks_padded_ids():
    c = dataclasses.replace(NANO, pad_vocab_to=128)
    model = GPT2(c, rngs=nnx.Rngs(0))
    wte = np.random.RandomState(1).randn(128, c.n_embd).astype(np.float32)
    model.wte.embedding.set_value(jnp.asarray(wte))
    x = jnp.asarray(np.random.RandomState(2).randn(2, 3, c.n_embd).astype(np.float32))
    logits = np.asarray(model._head(x))
    xn = np.asarray(x)
    ln = (xn - xn.mean(-1, keepdims=True)) / np.sqrt(xn.var(-1, keepdims=True) + c.layer_norm_epsilon)
    np.testing.assert_allclose(logits[..., : c.vocab_size], (ln @ wte.T)[..., : c.vocab_size], atol=1e-4)
    assert (logits[..., c.vocab_size:] == np.finfo(np.float32).min).all()


def test_residual_projections_use_the_scaled_init():
    c = GPT2Config(n_layer=8, n_head=4, n_embd=256, vocab_size=512, block_size=32)
    model = GPT2(c, rngs=nnx.Rngs(0))
    assert np.std(np.asarray(model.h.mlp.c_fc.kernel[...])) == pytest.approx(0.02, rel=0.05)
    assert np.std(np.asarray(model.h.mlp.c_proj.kernel[...])) == pytest.approx(0.02 / 4, rel=0.05)
    assert np.std(np.asarray(model.h.attn.c_proj.kernel[...])) == pytest.approx(0.02 / 4, rel=0.05)


# ---- equivalences ------------------------------------------------------------------------------


def unstack(scanned: GPT2) -> GPT2:
    """The same weights in a python-loop model (h.0, h.1, ... instead of a stacked h)."""
    c = dataclasses.replace(scanned.config, scan_layers=False)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: GPT2(c, rngs=nnx.Rngs(0))))
    source = flat(nnx.state(scanned))
    for path, var in nnx.to_flat_state(state):
        if path[0] == "h":
            var.set_value(jnp.asarray(source[("h", *path[2:])][path[1]]))
        else:
            var.set_value(jnp.asarray(source[path]))
    return nnx.merge(graphdef, state)


def test_scan_over_layers_equals_python_loop():
    scanned = GPT2(NANO, rngs=nnx.Rngs(0))
    looped = unstack(scanned)
    la, va, ga = loss_and_grads(scanned)
    lb, vb, gb = loss_and_grads(looped)
    np.testing.assert_allclose(np.asarray(la), np.asarray(lb), atol=1e-5)
    gb_stacked = {}
    for p, v in flat(gb).items():
        key = ("h", *p[2:]) if p[0] == "h" else p
        gb_stacked.setdefault(key, []).append((p[1] if p[0] == "h" else 0, v))
    gb_stacked = {k: (np.stack([v for _, v in sorted(vs)]) if k[0] == "h" else vs[0][1])
                  for k, vs in gb_stacked.items()}
    assert max_diff(flat(ga), gb_stacked) < 1e-5


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("policy", ["full", "dots"])
def test_remat_changes_nothing_but_memory(scan, policy):
    base = GPT2(dataclasses.replace(NANO, scan_layers=scan), rngs=nnx.Rngs(0))
    remat = GPT2(dataclasses.replace(NANO, scan_layers=scan, remat=policy), rngs=nnx.Rngs(0))
    la, va, ga = loss_and_grads(base)
    lb, vb, gb = loss_and_grads(remat)
    np.testing.assert_allclose(np.asarray(la), np.asarray(lb), atol=1e-5)
    assert max_diff(flat(ga), flat(gb)) < 1e-5


@pytest.mark.parametrize("attention, policy, saved", [
    ("xla", "dots", ["f32[2,8,3,2,16]"] * 2),  # each layer's [B, T, 3, H, K]
    ("splash", "dots", ["f32[2,2,128,16]"] * 6),  # each layer's q, k, v as the kernel reads them: [B, H, T, K]
    ("xla", "full", []),
])
def test_dots_remat_keeps_q_k_v_as_the_attention_reads_them(capsys, attention, policy, saved):
    """remat="dots" saves q, k and v after the bias add (and, for splash, heads-first: named "qkv"), not the
    projection's bare output, so the backward does not redo the add or the transpose; "full" keeps none (the
    control). Off a mesh: inside the splash kernel's shard_map JAX reports the kept values as the shard_map's
    outputs, not by name (the sharded program's effect is docs/aot_planning.md's gpt2_xl_pod compile)."""
    model = GPT2(dataclasses.replace(NANO, scan_layers=False, remat=policy, attention=attention), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tokens = jnp.zeros((2, 9), jnp.int32)
    jax.ad_checkpoint.print_saved_residuals(lambda p: next_token_loss(nnx.merge(graphdef, p), tokens), params)
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert [line.split()[0] for line in lines if "named 'qkv'" in line] == saved, printed
    assert not [line for line in lines if line.startswith("f32[2,8,3,2,16]") and "named" not in line]  # no bare copy


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cross_entropy_equals_optax_and_keeps_no_float32_softmax_for_bf16_logits(capsys, dtype):
    """cross_entropy gives optax's value and logits' gradient (of the float32 cast, in the logits' dtype; measured
    identical) with padded ids masked as GPT2._head masks them. For bfloat16 logits its backward keeps the logits as
    they came and one float32 per row, where optax's keeps a float32 softmax as large as the logits (the control);
    float32 logits are optax's own, residuals and all."""
    logits = (jax.random.normal(jax.random.key(0), (4, 8, 300)) * 3).astype(dtype)
    logits = logits.at[..., 257:].set(jnp.finfo(dtype).min)
    labels = jax.random.randint(jax.random.key(1), (4, 8), 0, 257)
    weights = jax.random.uniform(jax.random.key(2), (4, 8))  # each row its own cotangent

    def optax_loss(z):
        return (optax.softmax_cross_entropy_with_integer_labels(z.astype(jnp.float32), labels) * weights).sum()

    def ours(z):
        return (cross_entropy(z, labels) * weights).sum()

    (value, grad), (expected, expected_grad) = jax.value_and_grad(ours)(logits), jax.value_and_grad(optax_loss)(logits)
    assert grad.dtype == logits.dtype and float(value) == float(expected)
    np.testing.assert_array_equal(np.asarray(grad, np.float32), np.asarray(expected_grad, np.float32))
    kept = {}
    for name, loss in [("ours", ours), ("optax", optax_loss)]:
        jax.ad_checkpoint.print_saved_residuals(loss, logits)
        kept[name] = sorted(line.split()[0] for line in capsys.readouterr().out.splitlines())
    assert "f32[4,8,300]" in kept["optax"] and len(kept["optax"]) > 4, kept
    if dtype == "float32":
        assert kept["ours"] == kept["optax"]
    else:
        assert kept["ours"] == sorted(["bf16[4,8,300]", "f32[4,8]", "f32[4,8]", "i32[4,8]"]), kept  # + the weights


@pytest.mark.parametrize("blocks", [2, 4])
def test_blocked_causal_attention_equals_the_whole_triangle(blocks):
    base = GPT2(NANO, rngs=nnx.Rngs(0))
    blocked = GPT2(dataclasses.replace(NANO, attention_query_blocks=blocks), rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, NANO.vocab_size, (4, 13)), jnp.int32)  # T = 12
    la, va, ga = loss_and_grads(base, tokens)
    lb, vb, gb = loss_and_grads(blocked, tokens)
    np.testing.assert_allclose(np.asarray(la), np.asarray(lb), atol=1e-5)
    np.testing.assert_allclose(np.asarray(va), np.asarray(vb), atol=1e-6)
    assert max_diff(flat(ga), flat(gb)) < 1e-5


SHARDED = dataclasses.replace(NANO, n_head=4, pad_vocab_to=128)  # heads and vocab split over tensor=2


@functools.cache
def unsharded_reference():
    model = GPT2(SHARDED, rngs=nnx.Rngs(0))
    return flat(nnx.state(model)), loss_and_grads(model, jnp.tile(TOKENS, (2, 1)))


# Every preset on 2×2×2, where each splits something of its own; on 8×1×1 and 2×4×1 a preset that names a size-1
# axis lays out what another preset does (fsdp on 8×1×1 is dp, tp on 2×4×1 is dp), so one preset per layout.
LAYOUTS = [((8, 1, 1), "dp"), ((2, 4, 1), "fsdp"), *(((2, 2, 2), rules) for rules in sorted(RULES))]


@pytest.mark.parametrize("shape, rules", LAYOUTS, ids=lambda p: "x".join(map(str, p)) if isinstance(p, tuple) else p)
def test_sharded_equals_unsharded(shape, rules):
    mesh = make_mesh(*shape)
    table = ShardingRules.preset(rules)
    sharded = create_sharded_model(SHARDED, mesh, table, seed=0)
    # every parameter was born with the layout its logical names and the table give
    for path, var in nnx.to_flat_state(nnx.state(sharded, nnx.Param)):
        expected = jax.sharding.NamedSharding(mesh, table.spec(logical_axes_of(var)))
        assert var.get_value().sharding.is_equivalent_to(expected, var.get_value().ndim), path
    reference_params, (lr, vr, gr) = unsharded_reference()
    # same random bits whatever the layout (threefry is partitionable); jit vs eager rounding differs by ~1 ulp
    assert max_diff(flat(nnx.state(sharded)), reference_params) < 1e-7
    tokens = jnp.tile(TOKENS, (2, 1))  # batch 8: divisible by every data×fsdp size above
    with jax.set_mesh(mesh):
        ls, vs, gs = loss_and_grads(sharded, tokens)
    np.testing.assert_allclose(np.asarray(ls), np.asarray(lr), atol=1e-5)
    assert abs(float(vs) - float(vr)) < 1e-5
    assert max_diff(flat(gs), flat(gr)) < 1e-5


def test_param_report_lists_every_parameter_with_its_bytes():
    mesh = make_mesh(2, 2, 2)
    model = create_sharded_model(dataclasses.replace(NANO, pad_vocab_to=128), mesh, "fsdp_tp")
    report = param_report(model, mesh)
    assert "wte.embedding" in report and "P('tensor', 'fsdp')" in report
    # wte is [128, 32] float32 split 2 × 2 -> 64 × 16 × 4 bytes per device
    row = next(line for line in report.splitlines() if line.startswith("wte.embedding"))
    assert row.split()[-1] == f"{64 * 16 * 4:,}"
    assert report.splitlines()[-1].startswith("29,056 parameters") is False  # padded vocab counted
    assert f"{dataclasses.replace(NANO, pad_vocab_to=128).num_params():,} parameters" in report


@pytest.mark.parametrize("scan", [True, False])
def test_kv_cache_generation_equals_full_recompute(scan):
    model = GPT2(dataclasses.replace(NANO, scan_layers=scan), rngs=nnx.Rngs(0))
    prompt = TOKENS[:2, :4]
    for temperature, top_k in ((0.0, None), (1.0, 10)):
        cached = generate(model, prompt, 10, key=jax.random.PRNGKey(0), temperature=temperature, top_k=top_k)
        full = generate(model, prompt, 10, key=jax.random.PRNGKey(0), temperature=temperature, top_k=top_k,
                        use_cache=False)
        np.testing.assert_array_equal(np.asarray(cached), np.asarray(full))
    with pytest.raises(ValueError, match="exceeds the model's context of 16"):
        generate(model, prompt, 13, key=jax.random.PRNGKey(0))


# ---- Hugging Face parity -----------------------------------------------------------------------

HF_SHAPES = [
    dict(vocab_size=101, n_positions=32, n_embd=48, n_layer=3, n_head=4),
    dict(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=8),
]


@pytest.mark.parametrize("shape", HF_SHAPES, ids=["48x3", "64x2"])
@pytest.mark.parametrize("scan", [True, False])
def test_hf_import_and_export_match_transformers(tmp_path, shape, scan):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from gpt2 import from_hf, to_hf

    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**shape)).eval()
    hf.save_pretrained(tmp_path / "hf")
    ids = np.random.RandomState(0).randint(0, shape["vocab_size"], (2, 20))
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()

    ours = from_hf(tmp_path / "hf", scan_layers=scan, pad_vocab_to=128)
    logits = np.asarray(ours(jnp.asarray(ids)))[..., : shape["vocab_size"]]
    assert np.abs(logits - expected).max() <= 1e-4

    to_hf(ours, tmp_path / "export")
    mask = os.umask(0)  # the export's files get the user's umask, as any file written by hand would
    os.umask(mask)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "export").iterdir()} == \
        {name: oct(0o666 & ~mask) for name in ("config.json", "model.safetensors")}
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        again = reloaded(torch.tensor(ids)).logits.numpy()
    assert np.abs(again - logits).max() <= 1e-4


@pytest.mark.parametrize("rules", ["fsdp", "tp", "fsdp_tp"])
@pytest.mark.parametrize("scan", [True, False])
def test_a_sharded_hf_import_reads_each_shard_by_itself_and_equals_the_whole(tmp_path, monkeypatch, rules, scan):
    """Every device's shard is read from the memory-mapped file on its own (head-sharded `c_attn` columns in
    three runs, padded vocabulary rows as zeros): bitwise the unsharded import and the exported parameters,
    reading exactly the elements of the distinct shards (devices holding the same shard read it once)."""
    from gpt2 import from_hf, to_hf
    from gpt2.hf import SafetensorsFiles

    config = GPT2Config(vocab_size=200, block_size=32, n_layer=2, n_head=4, n_embd=32, pad_vocab_to=128,
                        scan_layers=scan)  # 256 rows: the second tensor shard holds 56 real and 72 padding
    original = nnx.state(GPT2(config, rngs=nnx.Rngs(0)), nnx.Param)
    to_hf(nnx.merge(*nnx.split(GPT2(config, rngs=nnx.Rngs(0)))), tmp_path)
    whole = nnx.state(from_hf(tmp_path, scan_layers=scan, pad_vocab_to=128), nnx.Param)
    read, reads = SafetensorsFiles.read, []

    def counted(self, name, box):
        region = read(self, name, box)
        reads.append(region.size)
        return region

    monkeypatch.setattr(SafetensorsFiles, "read", counted)
    sharded = nnx.state(from_hf(tmp_path, mesh=make_mesh(2, 2, 2), rules=rules, scan_layers=scan,
                                pad_vocab_to=128), nnx.Param)
    for (path, ours), theirs, exported in zip(nnx.to_flat_state(sharded), jax.tree.leaves(whole),
                                              jax.tree.leaves(original)):
        ours, exported = np.asarray(ours.get_value()), np.asarray(exported)
        np.testing.assert_array_equal(ours, np.asarray(theirs))
        if path[0] == "wte":  # the export keeps the real rows; the padding comes back as zeros
            ours, exported = ours[: config.vocab_size], exported[: config.vocab_size]
            assert not np.asarray(theirs)[config.vocab_size:].any()
        np.testing.assert_array_equal(ours, exported)
    distinct = 0
    for path, leaf in nnx.to_flat_state(sharded):
        regions = {tuple((s.start, s.stop) for s in index)
                   for index in leaf.get_value().sharding.devices_indices_map(leaf.get_value().shape).values()}
        for region in regions:
            sizes = [len(range(n)[slice(*r)]) for n, r in zip(leaf.get_value().shape, region)]
            if path[0] == "wte":  # the padding rows are not in the file
                sizes[0] = len(range(config.vocab_size)[slice(*region[0])])
            distinct += int(np.prod(sizes))
    assert sum(reads) == distinct


def test_hf_import_straight_into_a_sharded_layout(tmp_path):
    transformers = pytest.importorskip("transformers")
    from gpt2 import from_hf

    transformers.GPT2LMHeadModel(transformers.GPT2Config(**HF_SHAPES[1])).save_pretrained(tmp_path)
    mesh = make_mesh(2, 2, 2)
    model = from_hf(tmp_path, mesh=mesh, rules="fsdp_tp")
    kernel = model.h.mlp.c_fc.kernel.get_value()
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    from gpt2.hf import HFCheckpointError

    with pytest.raises(HFCheckpointError, match="missing: no such directory; give a Hugging Face checkpoint"):
        from_hf(tmp_path / "missing")
