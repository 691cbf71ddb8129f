"""Multislice, in-process (`--mesh.num_slices`, `plan.py --topology TOPOLOGY*N`): devices grouped into slices, one-line
errors before any work, a DCN transfer's cost in the step-time model, the planner's layouts inside a slice. A compile
for two v5e slices and two "slices" of processes training: tests/e2e/test_multislice.py."""

import dataclasses

import pytest

import configs
import plan as plan_app
import train as train_app
from errors import ConfigError
from planning import planner, step_time
from planning.chips import CHIPS
from planning.collectives import DCN_STEP_S
from planning.planner import Outcome
from planning.step_time import OP_OVERHEAD_S
from support.cli import SMALL, last_line, run_main
from trainer.program.mesh import slices_of

V5E = CHIPS["v5e"]


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int
    platform: str = "cpu"
    slice_index: int = 0


def test_cpu_devices_are_grouped_into_slices_by_process_and_tpu_devices_by_slice_index():
    # 4 processes of 2 devices, 2 slices: processes 0-1 and 2-3, however the devices are listed
    cpu = [FakeDevice(i, i // 2) for i in (6, 0, 3, 1, 2, 7, 4, 5)]
    assert [[d.id for d in s] for s in slices_of(cpu, 2)] == [[0, 3, 1, 2], [6, 7, 4, 5]]
    tpu = [FakeDevice(i, 0, "tpu", slice_index=1 - i // 4) for i in range(8)]  # slice_index, not the process
    assert [[d.id for d in s] for s in slices_of(tpu, 2)] == [[4, 5, 6, 7], [0, 1, 2, 3]]
    with pytest.raises(ConfigError, match=r"^mesh.num_slices=3: the 4 processes do not divide into 3 slices"):
        slices_of(cpu, 3)
    uneven = tpu[:6]  # slices of 4 and 2 devices
    with pytest.raises(ConfigError, match=r"the devices are in 2 slices of \[2, 4\] devices; expected 2 equal"):
        slices_of(uneven, 2)
    with pytest.raises(ConfigError, match=r"the devices are in 2 slices .* expected 4 equal slices"):
        slices_of(tpu, 4)


@pytest.mark.parametrize("flags, message", [
    (["--mesh.num_slices=3"], "mesh.num_slices=3: the 8 devices do not divide into 3 slices"),
    (["--mesh.num_slices=2"], "mesh.num_slices=2: the 1 processes do not divide into 2 slices (CPU devices are"
                              " grouped into slices by process)"),
    (["--mesh.num_slices=2", "--mesh.fsdp=8"], "mesh.num_slices=2: mesh.data=1 is not a multiple of it; data"
                                               " parallelism spans the slices, fsdp and tensor stay inside one"
                                               " (lower mesh.fsdp or mesh.tensor)"),
    (["--mesh.num_slices=2", "--mesh.data=3"], "mesh.data=3 must be a multiple of mesh.num_slices=2: data"
                                               " parallelism spans the slices (fsdp and tensor stay inside one)"),
    (["--mesh.num_slices=0"], "mesh.num_slices must be an integer >= 1, got 0"),
])
def test_a_bad_slice_count_is_one_line(tmp_path, flags, message):
    code, _, err = run_main(train_app.main, "--run_dir", str(tmp_path / "run"), *SMALL, *flags)
    # (a bound checked while the flags are parsed comes inside tyro's one-line wrapping)
    assert code == 2 and last_line(err).startswith("error: ") and message in last_line(err), err[-2000:]
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags, message", [
    (["--topology", "v5e:2x2*0"], "--topology v5e:2x2*0: the number of slices after '*' must be a positive integer,"
                                  " got '0' (e.g. v5e:16x16*2)"),
    (["--topology", "v5e:2x2*two"], "--topology v5e:2x2*two: the number of slices after '*' must be a positive"
                                    " integer, got 'two' (e.g. v5e:16x16*2)"),
    (["--topology", "v5e:2x2*2", "--mesh.num_slices=3"], "--topology v5e:2x2*2: 2 slice(s), but mesh.num_slices=3"),
    (["--topology", "v5e:2x2*x", "--search"], "--topology v5e:2x2*x: the number of slices after '*' must be a"
                                              " positive integer, got 'x' (e.g. v5e:16x16*2)"),
])
def test_a_bad_slice_count_for_plan_py_is_one_line(flags, message):
    code, _, err = run_main(plan_app.main, *SMALL, *flags)
    assert code == 2 and last_line(err) == f"error: {message}", err[-2000:]


# One slice's program as libtpu compiles it for 2 slices: the reduction across slices is a `send` to the DCN runtime
# (and a `recv` of the result), with a [1024, 1024] matmul scheduled between the send and its done.
MEGASCALE = ('is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",'
             '_xla_host_transfer_rendezvous="all-reduce.1_0",_xla_megascale_reduce_operation="SUM",'
             '_xla_megascale_target="{1,2}x{0:3}",_xla_megascale_transfer_type="ALL_REDUCE"}')


DONE = 'is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime"}'


HLO = f"""HloModule jit_step, is_scheduled=true

ENTRY %main (p0: bf16[1024,1024], p1: bf16[1024,1024]) -> bf16[1024,1024] {{
  %p0 = bf16[1024,1024]{{1,0}} parameter(0)
  %p1 = bf16[1024,1024]{{1,0}} parameter(1)
  %after-all = token[] after-all()
  %send = (bf16[1024,1024]{{1,0}}, u32[], token[]) send(%p0, %after-all), channel_id=2, {MEGASCALE}
  %recv = (bf16[1024,1024]{{1,0}}, u32[], token[]) recv(%after-all), channel_id=1, {MEGASCALE}
  %dot = bf16[1024,1024]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  %send-done = token[] send-done(%send), channel_id=2, {DONE}
  %recv-done = (bf16[1024,1024]{{1,0}}, token[]) recv-done(%recv), channel_id=1, {DONE}
  ROOT %sum = bf16[1024,1024]{{1,0}} get-tuple-element(%recv-done), index=0
}}
"""


@pytest.mark.parametrize("slices", [2, 4])
def test_a_transfer_between_slices_is_costed_at_the_hosts_dcn_bandwidth_and_hidden_by_the_ops_beside_it(slices):
    est = step_time.estimate_hlo(HLO, V5E, {"data": slices, "fsdp": 1, "tensor": 1}, slices=slices)
    (c,) = est.collectives
    array = 1024 * 1024 * 2
    # a ring all-reduce across the slices: 2 (s-1)/s of the array leaves each chip, at 25 Gbit/s (2 x 100 Gbit/s
    # NICs per 8-chip v5e host)
    assert V5E.dcn_bytes_per_s == 25e9 / 8
    assert (c.kind, c.axis, c.count, c.bytes) == ("all-reduce", f"DCN (data across {slices} slices)", 1, array)
    # plus one DCN step's latency at each of the ring's 2 (s-1) steps
    assert c.seconds == pytest.approx(2 * (slices - 1) / slices * array / V5E.dcn_bytes_per_s
                                      + 2 * (slices - 1) * DCN_STEP_S, rel=1e-12)
    matmul = max(2 * 1024**3 / 197e12, 3 * array / 737.7e9)  # the op scheduled between the send and its done
    assert est.roofline_s == pytest.approx(matmul, rel=1e-12) and est.fixed_s == pytest.approx(est.ops * OP_OVERHEAD_S)
    assert c.exposed == pytest.approx(c.seconds - matmul, rel=1e-12)
    assert est.bottleneck == f"collectives: all-reduce over DCN (data across {slices} slices)"
    assert "DCN 3.12 GB/s per chip (a host's NICs over its 8 chips) and 250 µs a step" in "\n".join(est.lines())


def test_plan_layouts_keep_fsdp_and_tensor_inside_a_slice():
    cfg = planner.apply(configs.load("gpt2_124m"), [("mesh.num_slices", 2)])
    meshes = [(o["mesh.rules"], o["mesh.data"], o["mesh.fsdp"], o["mesh.tensor"]) for o in planner.layouts(cfg, 8)]
    assert meshes == [("dp", 8, 1, 1), ("fsdp", 2, 4, 1), ("tp", 4, 1, 2), ("fsdp_tp", 2, 2, 2)]

    def stand_in(c, changes):  # every candidate fits; records the meshes the search asks for
        asked.append((c.mesh.num_slices, c.mesh.data))
        return Outcome(changes, True, 1.0, 0.1 + 0.01 * c.train.grad_accum, 0.5, "compute", 0.0)

    asked = []
    planner.plan(configs.load("gpt2_124m"), "v5e:2x2*2", budget_s=60, compile=stand_in,
                 show_progress=False)
    assert asked and all(slices == 2 and data % 2 == 0 for slices, data in asked)
