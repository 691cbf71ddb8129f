"""Step-time estimates read from compiled TPU programs: small programs compiled for v5e:2x2 through libtpu
(no TPU needed) whose FLOPs, loops and collectives are known by hand, agreement with libtpu's own cost model
where it gives one, the fixed costs, and the range the back-test gives a prediction's regime. The real train call:
tests/e2e/test_step_time.py (tiny) and tests/e2e/test_aot.py (gpt2_124m on v5e:2x4)."""

import dataclasses
import functools
import os
import random

# another process (a parallel test worker, a CLI run) may hold libtpu's lock file; compiling needs no TPU
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from planning import calibrate, hlo, op_cost, step_time  # noqa: E402
from planning.chips import CHIPS  # noqa: E402
from planning.step_time import estimate  # noqa: E402

pytest.importorskip("libtpu", reason="the `tpu` extra brings libtpu")

V5E = CHIPS["v5e"]


@pytest.fixture(scope="module")
def mesh():
    """v5e:2x2 as data 2 × fsdp 1 × tensor 2."""
    from planning.aot import topology_devices

    return jax.make_mesh((2, 1, 2), ("data", "fsdp", "tensor"), devices=topology_devices("v5e:2x2"))


def compiled(mesh, f, *args):
    with jax.set_mesh(mesh):
        return jax.jit(f).lower(*args).compile()


def bf16(mesh, shape, spec):
    return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))


def test_a_matmul_costs_its_exact_flops(mesh):
    x, w = bf16(mesh, (1024, 512), P(("data", "tensor"))), bf16(mesh, (512, 2048), P())
    e = estimate(compiled(mesh, jnp.matmul, x, w), V5E, mesh)
    rows = 1024 // 4
    assert e.flops == 2 * rows * 512 * 2048
    assert e.compute_s == pytest.approx(e.flops / op_cost.RATES["v5e"].mxu_flops_per_s)
    # reads x's block and w, writes the output block (less whatever the compiler keeps in VMEM)
    assert 0 < e.hbm_bytes <= 2 * (rows * 512 + 512 * 2048 + rows * 2048)
    assert e.collectives == () and e.unknown_loops == 0


def test_a_batched_dot_on_cpu_costs_its_exact_flops():
    # XLA:CPU keeps the `dot` op that TPU HLO turns into a convolution
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    a, b = (jax.ShapeDtypeStruct(shape, jnp.float32, sharding=cpu) for shape in ((3, 64, 128), (3, 128, 32)))
    program = jax.jit(lambda a, b: jnp.einsum("bij,bjk->bik", a, b)).lower(a, b).compile()
    assert step_time.estimate_hlo(program.as_text(), V5E, {"data": 1}).flops == 2 * 3 * 64 * 128 * 32


def test_a_scan_costs_its_body_times_its_trip_count(mesh):
    def layers(x, ws):  # [B, D], [L, D, D]
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]

    x = bf16(mesh, (1024, 512), P(("data", "tensor")))
    one, five = (compiled(mesh, layers, x, bf16(mesh, (n, 512, 512), P())) for n in (1, 5))
    body_flops = 2 * 256 * 512 * 512
    assert estimate(one, V5E, mesh).flops == body_flops
    assert estimate(five, V5E, mesh).flops == 5 * body_flops
    assert five.cost_analysis()["flops"] < 1.1 * body_flops  # what XLA's own count misses: the other four


def test_collectives_are_found_with_their_bytes_and_mesh_axis(mesh):
    def f(x):  # one device's [256, 512] float32 block: 512 KiB
        return (jax.lax.psum(x, "tensor"), jax.lax.all_gather(x, "data", tiled=True),
                jax.lax.psum_scatter(x, "data", tiled=True), jax.lax.ppermute(x, "data", [(0, 1), (1, 0)]))

    spec = P("data", "tensor")
    g = jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=(spec, spec, spec, spec), check_vma=False)
    x = jax.ShapeDtypeStruct((512, 1024), jnp.float32, sharding=NamedSharding(mesh, spec))
    e = estimate(compiled(mesh, g, x), V5E, mesh)
    block = 256 * 512 * 4
    found = {(c.kind, c.axis): c for c in e.collectives}
    assert set(found) == {("all-reduce", "tensor"), ("all-gather", "data"), ("reduce-scatter", "data"),
                          ("collective-permute", "data")}
    assert found["all-reduce", "tensor"].bytes == block
    assert found["all-gather", "data"].bytes == 2 * block  # the gathered [512, 512]
    assert found["reduce-scatter", "data"].bytes == block  # its input
    # a ring of 2: 2 (n-1)/n × B over both directions of a link; a permute: B over one link, one way
    assert found["all-reduce", "tensor"].seconds == pytest.approx(block / (2 * V5E.ici_link_bytes_per_s))
    assert found["collective-permute", "data"].seconds == pytest.approx(block / V5E.ici_link_bytes_per_s)


def test_replica_groups_in_every_spelling_map_to_mesh_axes():
    shape = {"data": 2, "fsdp": 1, "tensor": 2}
    spellings = {
        "replica_groups={{0,1},{2,3}}": "tensor",
        "replica_groups=[2,2]<=[4]": "tensor",
        "replica_groups=[2,2]<=[2,2]T(1,0)": "data",
        "replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_0'}": "data",
        # mesh positions hold the devices of an iota: [[0, 2], [1, 3]], so axis_0 runs along tensor
        "replica_groups=mesh['axis_0'=2,'axis_1'=2], device_ids=([2,2]T(1,0)) {'axis_0'}": "tensor",
        "replica_groups={}": "data+tensor",
        "source_target_pairs={{0,2},{2,0}}": "data",
    }
    for attrs, axis in spellings.items():
        assert hlo.mesh_axis(hlo.replica_groups(attrs, 4), shape) == axis, attrs


def test_a_batched_matmul_written_as_a_dilated_convolution_counts_only_real_taps():
    # TPU HLO's [B=4] batched matmul: window 4, stride 3, base dilation 4 over the batch; one real tap per output
    assert op_cost._valid_taps(4, 4, 4, 3, (0, 0), 4, 1) == 4
    assert op_cost._valid_taps(1, 3, 3, 1, (2, 2), 1, 1) == 3  # a kernel-reversed projection: one per output


# Shapes are drawn afresh each run (GPT-2's range, planning/calibrate.py); STEP_TIME_SEED=<n> repeats one
SEED = int(os.environ.get("STEP_TIME_SEED", random.randrange(2**31)))


@pytest.fixture(scope="module")
def chip_mesh():
    meshes = {}
    return lambda chip: meshes.setdefault(chip, calibrate.mesh_for(chip))


CHIPS_BY_SEED = list(calibrate.TOPOLOGIES)


def chip_for(op_class: str) -> str:
    """The chip an op class is checked on this run: each class on one chip, every chip on some class, the pairing
    rotating with the seed (planning/calibrate.py sweeps every pair; a test run needs a compile per pair it checks)."""
    return CHIPS_BY_SEED[(list(calibrate.OP_CLASSES).index(op_class) + SEED) % len(CHIPS_BY_SEED)]


@pytest.mark.parametrize("op_class", list(calibrate.OP_CLASSES))
def test_each_op_class_agrees_with_libtpus_cost_model(chip_mesh, op_class):
    """An op compiled on its own (its arrays in HBM: op_cost.HBM_ONLY) is predicted within [0.8, 1.25] of libtpu's
    optimal_seconds, for a shape drawn at random from the GPT-2 range."""
    chip = chip_for(op_class)
    rng = np.random.default_rng([SEED, list(calibrate.OP_CLASSES).index(op_class),
                                 list(calibrate.TOPOLOGIES).index(chip)])
    op = calibrate.OP_CLASSES[op_class](rng)
    row = calibrate.measure(op, chip, chip_mesh(chip))
    assert 0.8 <= row.ratio <= 1.25, (f"{op_class} on {chip}, {op.shape} (STEP_TIME_SEED={SEED}): ours"
                                      f" {row.ours_s * 1e6:.2f} us, libtpu {row.libtpu_s * 1e6:.2f} us")


@pytest.mark.parametrize("chip", list(calibrate.TOPOLOGIES))
def test_with_libtpus_vmem_accounting_a_default_compile_agrees_too(chip_mesh, chip):
    """Compiled with the compiler's defaults (prefetches into VMEM), an op of a class drawn at random is predicted
    within [0.8, 1.25] of libtpu when on-chip memory is counted as libtpu counts it (`libtpu_vmem`)."""
    rng = np.random.default_rng([SEED, 99, list(calibrate.TOPOLOGIES).index(chip)])
    mesh = chip_mesh(chip)
    op_class = rng.choice(list(calibrate.OP_CLASSES))
    op = calibrate.OP_CLASSES[op_class](rng)
    compiled = calibrate.compile_op(op, mesh, options={})
    ours = step_time.estimate_hlo(compiled.as_text(), chip, dict(mesh.shape), libtpu_vmem=True,
                                  fixed_costs=False).predicted_s
    ratio = ours / calibrate.libtpu_seconds(compiled)
    assert 0.8 <= ratio <= 1.25, f"{op_class} on {chip}, {op.shape} (STEP_TIME_SEED={SEED}): {ratio:.3f}"


def test_tile_padding_counts_in_the_bytes():
    assert hlo.stored_elements((8192, 100), "0,1:T(8,128)") == 8192 * 104  # 100 rows of 8192, 100 -> 104
    assert hlo.stored_elements((3, 12, 64), "2,1,0:T(8,128)(2,1)") == 3 * 16 * 128
    assert hlo.stored_elements((768,), "0:T(1024)") == 1024
    assert hlo.stored_elements((), "") == 1


B, T, H, K, BLOCK = 4, 1024, 4, 64, 128  # per chip [2, 1024, 2, 64]: 8 × 8 blocks, of which 36 causal


@pytest.fixture(scope="module")
def model_mesh():
    from trainer.program.mesh import make_mesh
    from planning.aot import topology_devices

    return make_mesh(2, 1, 2, devices=topology_devices("v5e:2x2"))  # the model's mesh: axes in Auto mode


@functools.cache
def _attention(mesh, kind: str, grad: bool):
    """Our estimate of causal attention on [B, T, H, K] (batch over data, heads over tensor), through the splash
    kernel or XLA's dot_product_attention, forward or forward + gradient."""
    from gpt2.sharding import ShardingRules
    from gpt2.splash import splash_attention

    rules = ShardingRules.preset("tp")

    def attend(q, k, v):
        if kind == "splash":
            return splash_attention(q, k, v, None, block_q=BLOCK, block_kv=BLOCK, rules=rules)
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    f = jax.grad(lambda *qkv: attend(*qkv).astype(jnp.float32).sum(), argnums=(0, 1, 2)) if grad else attend
    x = bf16(mesh, (B, T, H, K), P("data", None, "tensor"))
    return estimate(compiled(mesh, f, x, x, x), V5E, mesh)


def test_splash_kernels_cost_their_causal_blocks(model_mesh):
    e = _attention(model_mesh, "splash", grad=True)
    n = T // BLOCK
    causal_blocks = n * (n + 1) // 2  # of n × n: the kernel skips those above the diagonal
    scores = (2 * 2) * causal_blocks * BLOCK * BLOCK  # per chip 2 examples × 2 heads
    # forward 2 matmuls per block, dq 3, dkv 4; one exp per score in each of the three kernels
    assert e.flops == 2 * 9 * scores * K
    assert e.compute_s == pytest.approx(e.flops / op_cost.RATES["v5e"].mxu_flops_per_s
                                        + 3 * scores / op_cost.RATES["v5e"].transcendentals_per_s, rel=0.01)
    assert e.opaque_kernels == 0 and e.splash_kernels == 3
    assert any("splash attention: 3 kernel calls a step, costed from their block shapes" in line for line in e.lines())


def test_splash_costs_the_equivalent_xla_attentions_work_on_its_causal_blocks(model_mesh):
    """The forward kernel does XLA attention's work (QKᵀ, one exp per score, PV) on the causal blocks only (36 of
    8 × 8), at the same rates. Its exp runs between its two matmuls, so the three add up; XLA fuses the softmax
    into one of its matmuls, where libtpu's model overlaps an op's MXU and exp time (the larger counts): splash's
    compute is then 1 to 1.5x (at most when the exp and a matmul take equally long, as here) that fraction of
    XLA's. With the gradient splash does more per block (9 matmuls against XLA's 6; 3 exps per score against 1,
    as its backward recomputes P): 1.5 to 3x."""
    fraction, rates = 36 / 64, op_cost.RATES["v5e"]
    splash, xla = _attention(model_mesh, "splash", grad=False), _attention(model_mesh, "xla", grad=False)
    assert splash.flops == pytest.approx(fraction * xla.flops)
    scores = (2 * 2) * T * T  # per chip, all blocks
    assert splash.compute_s == pytest.approx(fraction * (xla.flops / rates.mxu_flops_per_s
                                                         + scores / rates.transcendentals_per_s))
    assert 1.0 <= splash.compute_s / (fraction * xla.compute_s) <= 1.5 + 1e-3
    splash, xla = _attention(model_mesh, "splash", grad=True), _attention(model_mesh, "xla", grad=True)
    assert 1.5 <= splash.compute_s / (fraction * xla.compute_s) <= 3.0


def _beside_a_matmul(mesh, collective, x_spec):
    """shard_map of `collective` on x [., 4096] beside an independent [4096, 4096]² matmul on every chip."""
    return jax.shard_map(lambda x, a, b: (collective(x), a @ b), mesh=mesh, in_specs=(x_spec, P(), P()),
                         out_specs=(P(), P()), check_vma=False)


def test_an_async_all_gather_is_hidden_by_the_matmul_scheduled_beside_it(chip_mesh):
    mesh = chip_mesh("v5e")  # 4 chips on "data"
    gather = _beside_a_matmul(mesh, lambda x: jax.lax.all_gather(x, "data", tiled=True), P("data"))
    # 32768 x 4096 gathered (256 MiB): 3/4 of it over the ring at 100 GB/s, 2 ms; the matmul 0.7 ms
    e = estimate(compiled(mesh, gather, bf16(mesh, (32768, 4096), P("data")), *[bf16(mesh, (4096, 4096), P())] * 2),
                 V5E, mesh)
    [c] = e.collectives
    assert (c.kind, c.axis) == ("all-gather", "data")
    assert c.seconds == pytest.approx(0.75 * 32768 * 4096 * 2 / V5E.ring_bytes_per_s)
    matmul_s = 2 * 4096**3 / op_cost.RATES["v5e"].mxu_flops_per_s
    assert 0 < c.exposed < c.seconds
    assert c.exposed == pytest.approx(c.seconds - matmul_s, rel=0.05)  # the matmul's fusion covers the rest
    assert e.predicted_s == pytest.approx(max(e.roofline_s + e.fixed_s + e.exposed_s, e.hbm_s))
    assert "hidden" in "\n".join(e.lines())


def test_a_synchronous_all_reduce_is_exposed_whatever_runs_beside_it(chip_mesh):
    mesh = chip_mesh("v5e")
    reduce = _beside_a_matmul(mesh, lambda x: jax.lax.psum(x, "data"), P())
    e = estimate(compiled(mesh, reduce, *[bf16(mesh, (4096, 4096), P())] * 3), V5E, mesh)
    [c] = e.collectives
    assert c.kind == "all-reduce" and c.seconds > 0
    assert c.exposed == c.seconds
    assert e.predicted_s == pytest.approx(e.roofline_s + e.fixed_s + c.seconds)


def test_a_small_collective_costs_its_hops_latency_not_its_bytes(chip_mesh):
    """An all-reduce of 4 KiB over 4 chips moves its bytes in 0.06 µs at the ring's bandwidth, but each of its
    hops costs ICI_HOP_S: a reduce-scatter and an all-gather of ⌊4/2⌋ hops each (the 4 chips of v5e:2x2 take one
    hop along each of the torus's two dimensions), 4 µs."""
    from planning.collectives import ICI_HOP_S

    mesh = chip_mesh("v5e")
    f = jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    x = jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=NamedSharding(mesh, P()))
    program = compiled(mesh, f, x).as_text()
    [c] = step_time.estimate_hlo(program, V5E, dict(mesh.shape)).collectives
    bandwidth = 2 * 3 / 4 * 8 * 128 * 4 / V5E.ring_bytes_per_s
    assert c.seconds == pytest.approx(2 * 2 * ICI_HOP_S) and c.seconds > 50 * bandwidth
    [bare] = step_time.estimate_hlo(program, V5E, dict(mesh.shape), fixed_costs=False).collectives
    assert bare.seconds == pytest.approx(bandwidth)


def test_the_report_gives_both_mfu_conventions():
    from gpt2 import GPT2Config
    from planning.step_report import StepTimeEstimate

    c = GPT2Config.gpt2()
    full, causal = c.flops_per_token(1024), c.flops_per_token(1024, causal=True)
    assert full - causal == 6 * 12 * 768 * 1024  # half of 12·L·D·T: the masked query-key pairs
    e = StepTimeEstimate(chip=V5E, flops=0.0, hbm_bytes=0.0, compute_s=0.05, hbm_s=0.05, roofline_s=0.1,
                         collectives=(), model_flops=full * 1e4, causal_model_flops=causal * 1e4)
    assert e.predicted_mfu / e.predicted_mfu_causal == pytest.approx(full / causal)


def test_the_range_comes_from_the_backtests_runs_of_the_same_regime(monkeypatch):
    """A prediction gets the measured / predicted range of the back-test's runs whose per-chip compute per step is
    within COMPARABLE_WORK of its own (and no faster than every resource at its peak); outside every run's regime,
    or with more of its step in exposed collectives than they had, it gets "no comparable measured run"."""
    from planning import backtest_band
    from planning.backtest_band import MeasuredRun
    from planning.step_report import StepTimeEstimate

    runs = (MeasuredRun("small", 0.02, 0.3, 2.5), MeasuredRun("mid", 0.2, 0.05, 0.9),
            MeasuredRun("large", 0.5, 0.05, 1.1), MeasuredRun("huge", 8.0, 0.02, 1.15))
    monkeypatch.setattr(backtest_band, "RUNS", runs)
    monkeypatch.setattr(backtest_band.band, "__defaults__", (runs,))
    monkeypatch.setattr(backtest_band.span, "__defaults__", (runs,))
    e = StepTimeEstimate(chip=V5E, flops=0.0, hbm_bytes=0.0, compute_s=0.25, hbm_s=0.05, roofline_s=0.3,
                         collectives=(), model_flops=1e13)
    assert e.expected()[2].runs == runs[1:3]  # 0.2 and 0.5 s are within 4x of 0.25 s; 0.02 and 8 s are not
    assert "expect 270–330 ms" in e.expected_range() and "2 published runs" in e.expected_range()
    assert f"MFU {e.predicted_mfu / 1.1:.0%}–{e.predicted_mfu / 0.9:.0%}" in e.expected_range()
    bound = dataclasses.replace(e, compute_s=0.29)  # never faster than every resource at its peak
    assert "expect 290–330 ms" in bound.expected_range()
    tiny = dataclasses.replace(e, compute_s=0.005, hbm_s=0.002, roofline_s=0.01)  # only "small" is near, at 2.5x
    assert "expect 10–25 ms" in tiny.expected_range() and "1 published run" in tiny.expected_range()
    assert "(small) measured 2.50× such predictions" in tiny.expected_range()
    nowhere = dataclasses.replace(e, compute_s=50.0, roofline_s=60.0)
    assert nowhere.expected() is None and nowhere.expected_range().startswith("no comparable measured run")
    from planning.collectives import Collective
    chatty = dataclasses.replace(e, collectives=(Collective("all-gather", "fsdp", 1, 1e9, 0.2, 0.2),))
    assert chatty.exposed_share > 0.05 + backtest_band.COMPARABLE_COLLECTIVES and chatty.expected() is None
