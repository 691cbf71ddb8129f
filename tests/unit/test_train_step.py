"""The train call in-process: the K-step scan and its active mask, gradient accumulation, optimizer details,
dropout and bfloat16 numerics, compile-once and sharding guards, parameters restored alone onto another mesh."""

import collections
import contextlib
import dataclasses
import functools
import itertools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.compilation_cache import compilation_cache

from configs.base import CheckpointConfig, Config, TrainConfig
from optim import GuardConfig
from optim.adamw import AdamWConfig
from optim.schedules import CosineSchedule
from errors import CheckpointError
from gpt2 import GPT2Config
from trainer.program.mesh import make_mesh
from gpt2.sharding import ShardingRules
from planning import hlo
from optim.base import decay_mask
from trainer.program.train_program import TrainProgram
from trainer.run.data_position import realign
from trainer.storage.checkpoints import Checkpoints
from support.train_calls import BATCHES, NANO_RUN, one_device, param_diff, run_calls


def with_model(cfg: Config, **model) -> Config:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model))


# one device with the default rules: the same programs as the one-device tests below (the session's compilation
# cache then compiles each once)
@pytest.mark.parametrize("mesh_shape, rules", [((1, 1, 1), NANO_RUN.mesh.rules), ((2, 2, 2), "fsdp_tp")])
def test_one_call_of_k_steps_equals_k_calls_of_one(mesh_shape, rules):
    cfg = dataclasses.replace(NANO_RUN, mesh=dataclasses.replace(NANO_RUN.mesh, rules=rules))
    mesh = make_mesh(*mesh_shape, devices=jax.devices()[: int(np.prod(mesh_shape))])
    scanned, losses_k4 = run_calls(cfg, mesh, [BATCHES])
    looped, losses_k1 = run_calls(cfg, mesh, [BATCHES[i : i + 1] for i in range(4)])
    np.testing.assert_allclose(losses_k4, losses_k1, rtol=0, atol=1e-6)
    assert param_diff(scanned["params"], looped["params"]) <= 1e-6
    assert int(scanned["step"]) == int(looped["step"]) == 4


def test_inactive_steps_leave_the_state_untouched():
    """A call of K=4 with only 2 active steps (how a run ends exactly at train.steps) equals a K=2 call:
    the skipped steps change no parameter, moment, step count or RNG key."""
    padded = np.concatenate([BATCHES[:2], np.zeros_like(BATCHES[2:])])
    masked, losses_masked = run_calls(NANO_RUN, one_device(), [padded], active=[np.array([1, 1, 0, 0], bool)])
    short, losses_short = run_calls(NANO_RUN, one_device(), [BATCHES[:2]])
    assert losses_masked == losses_short and int(masked["step"]) == 2
    assert param_diff(masked["params"], short["params"]) == 0
    assert param_diff(masked["opt_state"], short["opt_state"]) == 0


def test_the_compiled_train_call_holds_no_conditional():
    """Inactive steps are dropped by a select, not skipped by a lax.cond: XLA's GPU backend copies a conditional's
    predicate to the host and waits for the stream, so a K-step call would return only when its last step ended.
    The compiled call (the spike guard on: every branch the step has) holds no conditional; the scan stays a loop."""
    cfg = dataclasses.replace(NANO_RUN, guard=GuardConfig(skip_spikes=True))
    program = TrainProgram.build(cfg, one_device())
    with jax.set_mesh(program.mesh):
        text = program.lower().compile().as_text()
    assert "conditional(" not in text and "while(" in text


def test_gradient_accumulation_equals_one_big_batch():
    one, l1 = run_calls(NANO_RUN, one_device(), [BATCHES[:2]])
    accum = dataclasses.replace(NANO_RUN, train=dataclasses.replace(NANO_RUN.train, grad_accum=4))
    four, l4 = run_calls(accum, one_device(), [BATCHES[:2]])
    np.testing.assert_allclose(l1, l4, rtol=0, atol=1e-6)
    assert param_diff(one["params"], four["params"]) <= 1e-6


# ---- gradient accumulation on a mesh: each gradient reduced once per step ----------------------------------

ACCUM_BATCHES = np.random.RandomState(1).randint(0, 96, (2, 16, 17)).astype(np.int32)  # [K, B, T+1]


def accumulating(rules: str, grad_accum: int = 4, **model) -> Config:
    """NANO_RUN with `rules`, 16 rows per step (4 micro-batches of one row per data × fsdp device on 2×2×2); one
    step per call when lowered."""
    train = dataclasses.replace(NANO_RUN.train, batch_size=16, grad_accum=grad_accum, steps_per_call=1)
    cfg = dataclasses.replace(NANO_RUN, mesh=dataclasses.replace(NANO_RUN.mesh, rules=rules), train=train)
    return with_model(cfg, **model)


@pytest.mark.parametrize("rules", ["dp", "fsdp"])
def test_accumulation_on_a_mesh_equals_one_pass_over_the_batch(rules):
    """2×2×2 mesh, 2 steps of 4 micro-batches vs the same 16 rows in one pass (the same mean: what the scan that
    reduced every micro-batch computed too). float32; measured (one call of both steps each side): losses to 1.1e-7
    relative, parameters to 8e-8;
    the bounds (1e-5 relative, 1e-6 absolute on parameters of scale 0.02) leave room for summation order only."""
    mesh = make_mesh(2, 2, 2)
    one, losses_one = run_calls(accumulating(rules, grad_accum=1), mesh, [ACCUM_BATCHES])
    accum, losses_accum = accumulated_without_dropout(rules)
    np.testing.assert_allclose(losses_accum, losses_one, rtol=1e-5, atol=0)
    assert param_diff(accum["params"], one["params"]) <= 1e-6


def shard_by_shard(shards: int, devices: int):
    """A TrainProgram whose accumulation is the explicit reference for dropout: on one device, shard by shard
    and micro-batch by micro-batch. The step's rows lie on `devices` batch devices in contiguous runs, `shards`
    groups of them; micro-batch a of shard s is the a-th of A slices of each of its devices' rows, with dropout
    key fold_in(split(key, A)[a], s). The (shard, micro-batch) pairs go through one lax.map: one gradient to
    compile, not shards × A of them."""

    class ShardByShard(TrainProgram):
        def _grads(self, params, batch, dropout_key):
            A, width = self.config.train.grad_accum, batch.shape[-1]
            rows = batch.reshape(shards, devices // shards, A, -1, width)  # [shard, device, micro-batch, row, T+1]
            keys = jax.random.split(dropout_key, A)

            def part(pair):
                s, a = pair
                return jax.value_and_grad(self._loss)(params, rows[s, :, a].reshape(-1, width),
                                                      jax.random.fold_in(keys[a], s))

            pairs = jnp.divmod(jnp.arange(shards * A), A)
            return jax.tree.map(lambda x: x.mean(0), jax.lax.map(part, pairs))

    return ShardByShard


@functools.cache
def accumulated_without_dropout(rules: str):
    """(state, losses) of `accumulating(rules)` on 2×2×2, one step per call (the program whose reductions
    test_accumulation_reduces_each_gradient_once_per_step reads): two tests' reference, run once."""
    return run_calls(accumulating(rules), make_mesh(2, 2, 2), [ACCUM_BATCHES[:1], ACCUM_BATCHES[1:]])


@pytest.mark.parametrize("rules, shards", [("dp", 4), ("fsdp", 2)])
def test_accumulation_with_dropout_equals_running_it_shard_by_shard(rules, shards):
    """Dropout's masks differ per shard (dp: each of the 4 data × fsdp devices; fsdp: each data pair of fsdp
    devices). The 2×2×2 run equals the reference computed on one device; float32, measured: losses to 1.1e-7
    relative, parameters to 9e-8; bounds as for dropout off."""
    cfg = accumulating(rules, dropout=0.1)
    accum, losses_accum = run_calls(cfg, make_mesh(2, 2, 2), [ACCUM_BATCHES])
    reference = shard_by_shard(shards, devices=4).build(cfg, one_device())
    ref, losses_ref = run_calls(cfg, one_device(), [ACCUM_BATCHES], program=reference)
    np.testing.assert_allclose(losses_accum, losses_ref, rtol=1e-5, atol=0)
    assert param_diff(accum["params"], ref["params"]) <= 1e-6
    _, no_dropout = accumulated_without_dropout(rules)
    assert all(abs(a - b) > 1e-4 for a, b in zip(losses_accum, no_dropout))  # dropout really ran


def reductions(cfg: Config, mesh) -> dict[tuple[bool, str], float]:
    """Bytes all-reduced or reduce-scattered per call of the compiled train call, by (inside the accumulation loop,
    mesh axes): read with planning/hlo.py's HLO reader; the accumulation loop is the one of grad_accum trips."""
    trainer = TrainProgram.build(cfg, mesh)
    with jax.set_mesh(mesh):
        comps, entry = hlo.parse_hlo(trainer.lower().compile().as_text())
    found = collections.defaultdict(float)

    def walk(name: str, inside: bool):
        comp = comps[name]
        for instr in comp.instrs.values():
            if instr.opcode.removesuffix("-start") in ("all-reduce", "reduce-scatter"):
                groups = hlo.replica_groups(instr.attrs, mesh.size)
                found[inside, hlo.mesh_axis(groups, dict(mesh.shape))] += instr.bytes
            accumulation = instr.opcode == "while" and hlo.trip_count(instr, comp, comps) == cfg.train.grad_accum
            for called in hlo.called(instr, "body", "calls", "to_apply", "branch_computations"):
                walk(called, inside or accumulation)

    walk(entry, False)
    return dict(found)


def test_rules_name_the_batch_axes_gradients_are_reduced_over_once():
    assert ShardingRules.preset("dp").replica_batch_axes() == ("data", "fsdp")
    assert ShardingRules.preset("tp").replica_batch_axes() == ("data", "fsdp")
    assert ShardingRules.preset("fsdp").replica_batch_axes() == ("data",)
    assert ShardingRules.preset("fsdp_tp").replica_batch_axes() == ("data",)


def test_accumulation_reduces_each_gradient_once_per_step():
    """The compiled call on 2×2×2, one step of 4 micro-batches. dp: nothing is reduced inside the accumulation
    loop (the scan this replaced all-reduced 77,700 bytes over data × fsdp per micro-batch), and after it each
    float32 gradient once, with the loss. fsdp: inside the loop only fsdp's own per-micro-batch reductions of the
    fsdp-split gradients, never over data; after it each gradient's fsdp shard once over data, with the loss."""
    mesh = make_mesh(2, 2, 2)

    def gradient_bytes(rules):  # float32 gradients laid out as the parameters, per device
        params = jax.tree.leaves(TrainProgram.build(accumulating(rules), mesh).abstract_params)
        return sum(math.prod(p.sharding.shard_shape(p.shape)) * p.dtype.itemsize for p in params)

    assert reductions(accumulating("dp"), mesh) == {(False, "data+fsdp"): gradient_bytes("dp") + 4}
    fsdp = reductions(accumulating("fsdp"), mesh)
    assert not [axes for inside, axes in fsdp if inside and "data" in axes]
    assert fsdp[False, "data"] == gradient_bytes("fsdp") + 4
    assert (True, "fsdp") in fsdp


def test_weight_decay_skips_biases_and_norms_even_when_stacked():
    trainer = TrainProgram.build(NANO_RUN, one_device())
    mask = {path: bool(v.get_value()) for path, v in nnx.to_flat_state(decay_mask(trainer.abstract_state()["params"]))}
    assert mask[("h", "mlp", "c_fc", "kernel")] and mask[("wte", "embedding")]
    assert not mask[("h", "ln_1", "scale")]  # [L, D] with scan_layers, still a vector per layer
    assert not mask[("h", "attn", "c_attn", "bias")] and not mask[("ln_f", "bias")]


def test_schedule_warms_up_then_decays_to_the_floor():
    s = CosineSchedule(warmup_steps=10, min_lr_ratio=0.1).rate(1.0, total_steps=110)
    assert float(s(0)) == 0.0 and float(s(5)) == pytest.approx(0.5)
    assert float(s(10)) == pytest.approx(1.0)
    assert float(s(60)) == pytest.approx(0.55, abs=1e-6)  # halfway down the cosine
    assert float(s(110)) == pytest.approx(0.1) and float(s(500)) == pytest.approx(0.1)


# ---- dropout ----------------------------------------------------------------------------------------


def test_dropout_depends_on_the_key_and_zero_dropout_is_deterministic():
    cfg = with_model(NANO_RUN, dropout=0.1)
    trainer = TrainProgram.build(cfg, one_device())
    with jax.set_mesh(trainer.mesh):
        params = trainer.init_state()["params"]
        batch = jnp.asarray(BATCHES[0])
        loss = jax.jit(trainer._loss)
        a, b = loss(params, batch, jax.random.PRNGKey(1)), loss(params, batch, jax.random.PRNGKey(2))
        assert float(a) != float(b)  # another key drops other units
        assert float(loss(params, batch, jax.random.PRNGKey(1))) == float(a)  # the same key, the same loss
        assert float(loss(params, batch, None)) not in (float(a), float(b))  # no key: no dropout
    _, run1 = run_calls(NANO_RUN, one_device(), [BATCHES])
    _, run2 = run_calls(NANO_RUN, one_device(), [BATCHES])
    assert run1 == run2  # dropout 0: bitwise repeatable


def test_dropout_k4_call_equals_four_k1_calls():
    """The dropout key is folded from the step, so grouping steps into calls changes nothing."""
    cfg = with_model(NANO_RUN, dropout=0.1)
    scanned, losses_k4 = run_calls(cfg, one_device(), [BATCHES])
    looped, losses_k1 = run_calls(cfg, one_device(), [BATCHES[i : i + 1] for i in range(4)])
    np.testing.assert_allclose(losses_k4, losses_k1, rtol=0, atol=1e-6)
    assert param_diff(scanned["params"], looped["params"]) <= 1e-6
    _, no_dropout = run_calls(NANO_RUN, one_device(), [BATCHES])
    assert all(a != b for a, b in zip(losses_k4[1:], no_dropout[1:]))  # dropout really ran


# ---- bfloat16 (the TPU presets' compute dtype) -------------------------------------------------------

BF16_SHAPE = dict(n_layer=2, n_head=2, n_embd=64, block_size=64)


def _corpus_batches(shakespeare, n):
    from data.loader import LoaderConfig, make_dataset, open_corpus

    files = open_corpus(shakespeare, vocab_size=50257, min_tokens=65).files("train")
    cfg = LoaderConfig(seq_len=64, batch_size=8, seed=0)
    return [b[None] for b in itertools.islice(make_dataset(files, 50257, cfg, shard_index=0, shard_count=1), n)]


def _bf16_run(dtype, vocab_size=50257):
    return Config(model=GPT2Config(**BF16_SHAPE, vocab_size=vocab_size, dtype=dtype),
                  optim=AdamWConfig(lr=1e-3), schedule=CosineSchedule(warmup_steps=5),
                  train=TrainConfig(batch_size=8, seq_len=64, steps=30, steps_per_call=1))


def test_bfloat16_forward_stays_near_float32(shakespeare):
    """Same float32 parameters, bf16 vs f32 compute. Measured on this model: max |Δlogit| 0.0057 at logits
    up to 1.1 (0.5 %, bf16's 8-bit mantissa is 0.4 %); the bound 0.015 is 2.6× that, and far below what a
    bf16 softmax or loss would cost (the loss stays in float32: a bf16 log-softmax over 50k ids shifts it by
    ~0.05)."""
    batch = jnp.asarray(_corpus_batches(shakespeare, 1)[0][0])
    logits, losses = {}, {}
    for dtype in ("float32", "bfloat16"):
        trainer = TrainProgram.build(_bf16_run(dtype), one_device())
        with jax.set_mesh(trainer.mesh):
            params = trainer.init_state()["params"]  # same seed: the same float32 parameters
            logits[dtype] = np.asarray(trainer.model(params)(batch[:, :-1]), np.float32)
            losses[dtype] = float(trainer._loss(params, batch, None))
    assert np.abs(logits["float32"] - logits["bfloat16"]).max() <= 0.015
    assert abs(losses["float32"] - losses["bfloat16"]) <= 2e-3


def test_bfloat16_training_tracks_float32_at_every_step(shakespeare):
    """30 steps on the embedded corpus, its GPT-2 ids renumbered 0 … n-1 in order of value, so that the vocabulary
    is the 3,108 ids the batches hold (a head over all 50,257 was most of the test's work). Measured: the per-step
    loss differs by at most 1.25e-3 (the loss falls 8.03 -> 7.18 over the run); the bound 3e-3 is 2.4x that,
    0.4 % of the progress made."""
    stack = np.concatenate(_corpus_batches(shakespeare, 30))  # one call of 30 steps
    ids, dense = np.unique(stack, return_inverse=True)
    batches = [dense.reshape(stack.shape).astype(np.int32)]
    _, f32 = run_calls(_bf16_run("float32", len(ids)), one_device(), batches)
    _, bf16 = run_calls(_bf16_run("bfloat16", len(ids)), one_device(), batches)
    np.testing.assert_allclose(bf16, f32, rtol=0, atol=3e-3)
    assert f32[0] - f32[-1] > 0.5  # it trained


# ---- compile and sharding guards ---------------------------------------------------------------------


def test_train_call_compiles_once_and_holds_no_materialized_mask():
    """Regression guards that time nothing: no recompiles between calls (full or partial); causal masking
    stays implicit."""
    cfg = dataclasses.replace(NANO_RUN, train=dataclasses.replace(NANO_RUN.train, steps_per_call=2))
    trainer = TrainProgram.build(cfg, one_device())
    with jax.set_mesh(trainer.mesh):
        call = trainer.train_call()
        state = trainer.init_state()
        for i, active in enumerate(([1, 1], [1, 1], [1, 0])):  # fresh batches, same shapes: one executable
            batch = np.random.RandomState(i).randint(0, 96, (2, 8, 17)).astype(np.int32)
            state, _ = call(state, jax.device_put(batch, trainer.batch_sharding), np.array(active, bool))
        assert call._cache_size() == 1
        hlo = trainer.lower().as_text()
    T = 16
    constants = [line for line in hlo.splitlines() if "constant" in line and f"{T}x{T}x" in line.replace(",", "x")]
    assert not constants, constants[:3]


@contextlib.contextmanager
def persistent_cache_off():
    """Every compile in the block runs XLA's passes: a program loaded from the session's persistent cache (the K=1
    call on 2×2×2 is the K-step equivalence's) skips the SPMD partitioner, and so its log."""
    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # JAX decides once per process whether it uses the cache
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()


@pytest.mark.parametrize("rules, mesh_shape", [("fsdp", (2, 4, 1)), ("fsdp_tp", (2, 2, 2))])
def test_sharded_train_call_never_replicates_activations(capfd, rules, mesh_shape):
    """The SPMD partitioner logs "Involuntary full rematerialization" when it can only reshard a tensor by
    replicating it whole (it did for the embedding lookup: embed-sharded rows vs batch-sharded activations)."""
    cfg = dataclasses.replace(NANO_RUN, mesh=dataclasses.replace(NANO_RUN.mesh, rules=rules),
                              train=dataclasses.replace(NANO_RUN.train, steps_per_call=1))
    trainer = TrainProgram.build(cfg, make_mesh(*mesh_shape, devices=jax.devices()))
    capfd.readouterr()
    with jax.set_mesh(trainer.mesh), persistent_cache_off():
        trainer.lower().compile()
    log = capfd.readouterr().err
    assert "Involuntary full rematerialization" not in log, log[:2000]


def test_parameters_restore_alone_onto_another_mesh(tmp_path):
    """eval.py reads only the parameters of a train state (not the optimizer moments), onto any mesh."""
    trainer = TrainProgram.build(NANO_RUN, one_device())
    state, _ = run_calls(NANO_RUN, trainer.mesh, [BATCHES[:2]])  # non-trivial params and Adam moments
    ckpt = Checkpoints(tmp_path, CheckpointConfig(async_save=False))
    ckpt.save(2, state, None, {"config": {}})
    ckpt.close()
    fsdp_tp = dataclasses.replace(NANO_RUN, mesh=dataclasses.replace(NANO_RUN.mesh, rules="fsdp_tp"))
    other = TrainProgram.build(fsdp_tp, make_mesh(2, 2, 2, devices=jax.devices()))
    params = Checkpoints(tmp_path, CheckpointConfig(), read_only=True).restore_params(2, other.abstract_params)
    assert jax.tree.structure(params) == jax.tree.structure(state["params"])
    assert param_diff(params, state["params"]) == 0
    shardings = jax.tree.leaves(other.state_shardings["params"])
    assert [a.sharding for a in jax.tree.leaves(params)] == shardings
    assert any(s.spec != jax.sharding.PartitionSpec() for s in shardings)  # really laid out on the new mesh


def test_resume_refuses_old_metadata_without_the_batch_grouping(tmp_path):
    with pytest.raises(CheckpointError, match="lacks train.steps_per_call / train.batch_size"):
        realign({"config": {"train": {"batch_size": 8}}}, NANO_RUN, None, tmp_path)


def test_the_cpu_peak_is_the_best_measured_on_the_machine(tmp_path, monkeypatch):
    """A measurement under load (lower) never replaces the cached peak; a better one does."""
    from trainer import hardware

    measured = iter([123e9, 5e9, 200e9, 150e9])
    monkeypatch.setattr(hardware, "PEAK_CACHE", str(tmp_path / "peak.json"))
    monkeypatch.setattr(hardware, "measure_matmul_peak", lambda repeats: next(measured))
    # the best of the first three measurements (the machine may be busy for one), then read without measuring
    assert [hardware.cpu_peak_flops() for _ in range(5)] == [123e9, 123e9, 200e9, 200e9, 200e9]
    cache = json.loads((tmp_path / "peak.json").read_text())
    assert list(cache.values()) == [{"flops": 200e9, "samples": 3}] and "cores | jax " in next(iter(cache))
    assert next(measured) == 150e9  # not taken


_HEAP_PROBE = """
import ctypes, sys
from trainer.malloc import keep_freed_memory
if sys.argv[1] == "on":
    assert keep_freed_memory()
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
block = libc.malloc(256 << 20)
mmapped = libc.mallinfo2().hblkhd
libc.free(block)
print(mmapped >> 20, libc.mallinfo2().arena >> 20)
"""


@pytest.mark.parametrize("mode", ["on", "off"])
def test_keep_freed_memory_serves_big_blocks_from_a_retained_heap(mode):
    """A 256 MB block (an XLA temporary's size) comes from the heap and stays mapped after `free`."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _HEAP_PROBE, mode], capture_output=True, text=True, check=True)
    mmapped_mb, heap_after_free_mb = map(int, out.stdout.split())
    if mode == "on":
        assert mmapped_mb < 256 <= heap_after_free_mb
    else:  # glibc's default, which the tuning exists to change
        assert mmapped_mb >= 256 > heap_after_free_mb
