"""Training: the K-step scan, gradient accumulation, optimizer details, and the real train.py / eval.py CLIs."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.base import CheckpointConfig, Config, OptimConfig, TrainConfig
from conftest import SMALL, read_jsonl, run_cli
from gpt2 import GPT2Config, make_mesh
from trainer.checkpoint import CheckpointError, Checkpoints, realign_data
from trainer.optim import decay_mask, lr_schedule
from trainer.step import Trainer

NANO_RUN = Config(model=GPT2Config.nano(), train=TrainConfig(batch_size=8, seq_len=16, steps=10),
                  optim=OptimConfig(warmup_steps=2))
BATCHES = np.random.RandomState(0).randint(0, 96, (4, 8, 17)).astype(np.int32)  # [K, B, T+1]


def run_calls(cfg: Config, mesh, stacks):
    trainer = Trainer.build(cfg, mesh)
    with jax.set_mesh(mesh):
        call = trainer.train_call()
        state = trainer.init_state()
        losses = []
        for stack in stacks:
            state, metrics = call(state, jax.device_put(stack, trainer.batch_sharding))
            losses.extend(np.asarray(metrics["loss"]).tolist())
        return state, losses


def param_diff(a, b) -> float:
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(jnp.abs(x - y).max()), a, b)))


@pytest.mark.parametrize("mesh_shape, rules", [((1, 1, 1), "dp"), ((2, 2, 2), "fsdp_tp")])
def test_one_call_of_k_steps_equals_k_calls_of_one(mesh_shape, rules):
    cfg = dataclasses.replace(NANO_RUN, mesh=dataclasses.replace(NANO_RUN.mesh, rules=rules))
    mesh = make_mesh(*mesh_shape, devices=jax.devices()[: int(np.prod(mesh_shape))])
    scanned, losses_k4 = run_calls(cfg, mesh, [BATCHES])
    looped, losses_k1 = run_calls(cfg, mesh, [BATCHES[i : i + 1] for i in range(4)])
    np.testing.assert_allclose(losses_k4, losses_k1, rtol=0, atol=1e-6)
    assert param_diff(scanned["params"], looped["params"]) <= 1e-6
    assert int(scanned["step"]) == int(looped["step"]) == 4


def test_gradient_accumulation_equals_one_big_batch():
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    one, l1 = run_calls(NANO_RUN, mesh, [BATCHES[:2]])
    accum = dataclasses.replace(NANO_RUN, train=dataclasses.replace(NANO_RUN.train, grad_accum=4))
    four, l4 = run_calls(accum, mesh, [BATCHES[:2]])
    np.testing.assert_allclose(l1, l4, rtol=0, atol=1e-6)
    assert param_diff(one["params"], four["params"]) <= 1e-6


def test_weight_decay_skips_biases_and_norms_even_when_stacked():
    trainer = Trainer.build(NANO_RUN, make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    mask = {path: bool(v.get_value()) for path, v in nnx.to_flat_state(decay_mask(trainer.abstract_state()["params"]))}
    assert mask[("h", "mlp", "c_fc", "kernel")] and mask[("wte", "embedding")]
    assert not mask[("h", "ln_1", "scale")]  # [L, D] with scan_layers, still a vector per layer
    assert not mask[("h", "attn", "c_attn", "bias")] and not mask[("ln_f", "bias")]


def test_schedule_warms_up_then_decays_to_the_floor():
    s = lr_schedule(OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1), total_steps=110)
    assert float(s(0)) == 0.0 and float(s(5)) == pytest.approx(0.5)
    assert float(s(10)) == pytest.approx(1.0)
    assert float(s(60)) == pytest.approx(0.55, abs=1e-6)  # halfway down the cosine
    assert float(s(110)) == pytest.approx(0.1) and float(s(500)) == pytest.approx(0.1)


# ---- the real CLIs -----------------------------------------------------------------------------


def train_args(run_dir, shakespeare, *extra):
    return ["--run_dir", str(run_dir), f"--data.cache_dir={shakespeare}", *SMALL, "--train.steps=12",
            "--checkpoint.every=4", "--checkpoint.keep=5", "--train.eval_every=4", *extra]


def test_parameters_restore_alone_onto_another_mesh(tmp_path):
    """eval.py reads only the parameters of a train state (not the optimizer moments), onto any mesh."""
    trainer = Trainer.build(NANO_RUN, make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    state, _ = run_calls(NANO_RUN, trainer.mesh, [BATCHES[:2]])  # non-trivial params and Adam moments
    ckpt = Checkpoints(tmp_path, CheckpointConfig(async_save=False))
    ckpt.save(2, state, None, {"step": 2})
    ckpt.close()
    fsdp_tp = dataclasses.replace(NANO_RUN, mesh=dataclasses.replace(NANO_RUN.mesh, rules="fsdp_tp"))
    other = Trainer.build(fsdp_tp, make_mesh(2, 2, 2, devices=jax.devices()))
    params = Checkpoints(tmp_path, CheckpointConfig(), read_only=True).restore_params(2, other.abstract_params)
    assert jax.tree.structure(params) == jax.tree.structure(state["params"])
    assert param_diff(jax.device_get(params), jax.device_get(state["params"])) == 0
    shardings = jax.tree.leaves(other.state_shardings["params"])
    assert [a.sharding for a in jax.tree.leaves(params)] == shardings
    assert any(s.spec != jax.sharding.PartitionSpec() for s in shardings)  # really laid out on the new mesh


def test_resume_refuses_metadata_without_the_batch_grouping(tmp_path):
    with pytest.raises(CheckpointError, match="lacks train.steps_per_call / train.batch_size"):
        realign_data({"config": {"train": {"batch_size": 8}}}, NANO_RUN, None, tmp_path)


@pytest.fixture(scope="module")
def k4_run(tmp_path_factory, shakespeare):
    """12 steps, K=4, on 8 devices with a 2×2×2 fsdp_tp mesh, wandb offline."""
    run_dir = tmp_path_factory.mktemp("k4")
    r = run_cli("train.py", *train_args(run_dir, shakespeare, "--train.steps_per_call=4", "--mesh.data=2",
                                        "--mesh.fsdp=2", "--mesh.tensor=2", "--mesh.rules=fsdp_tp",
                                        "--log.wandb=offline", "--train.sample_tokens=8"))
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir, r


@pytest.fixture(scope="module")
def k1_run(tmp_path_factory, shakespeare):
    """The same 12 steps one per call, on a single device."""
    run_dir = tmp_path_factory.mktemp("k1")
    r = run_cli("train.py", *train_args(run_dir, shakespeare, "--train.steps_per_call=1"), devices=1)
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir, r


def step_losses(run_dir):
    return [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


def test_cli_run_leaves_metrics_checkpoints_plot_config_and_sample(k4_run):
    run_dir, result = k4_run
    records = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert set(steps[0]) == {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu"}
    assert steps[-1]["tokens"] == 12 * 8 * 32
    assert [r["step"] for r in records if "val_loss" in r] == [4, 8, 12]
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == [4, 8, 12]
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((run_dir / "config.json").read_text())["mesh"]["rules"] == "fsdp_tp"
    assert "--- sample ---\nROMEO:" in result.stdout
    assert "wte.embedding" in result.stdout  # the parameter report


def test_cli_losses_fall(k4_run):
    val = [r["val_loss"] for r in read_jsonl(k4_run[0] / "metrics.jsonl") if "val_loss" in r]
    assert val[0] > val[1] > val[2]


def wandb_records(path):
    """The protobuf records of a .wandb file (wandb's LevelDB-style log: 32 KiB blocks, 7-byte headers)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_cli_wandb_offline_run_holds_the_logged_metrics(k4_run):
    run_dir, _ = k4_run
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    history = list(runs[0].glob("run-*.wandb"))
    assert history and history[0].stat().st_size > 0
    logged = [{item.key or ".".join(item.nested_key): item.value_json for item in rec.history.item}
              for rec in wandb_records(history[0]) if rec.WhichOneof("record_type") == "history"]
    losses = [json.loads(h["loss"]) for h in logged if "loss" in h]
    assert losses == pytest.approx(step_losses(run_dir), abs=1e-6)
    assert [json.loads(h["val_loss"]) for h in logged if "val_loss" in h] == pytest.approx(
        [r["val_loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "val_loss" in r])


def test_cli_k4_on_8_devices_equals_k1_on_1_device(k4_run, k1_run):
    np.testing.assert_allclose(step_losses(k4_run[0]), step_losses(k1_run[0]), rtol=0, atol=1e-5)


def test_cli_exact_resume_is_bitwise(k4_run, shakespeare, tmp_path):
    extra = ["--train.steps_per_call=4", "--mesh.data=2", "--mesh.fsdp=2", "--mesh.tensor=2",
             "--mesh.rules=fsdp_tp"]
    first = run_cli("train.py", *train_args(tmp_path, shakespeare, *extra, "--train.stop_after=4"))
    assert first.returncode == 0, first.stderr[-3000:]
    assert len(step_losses(tmp_path)) == 4
    second = run_cli("train.py", *train_args(tmp_path, shakespeare, *extra))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout
    assert step_losses(tmp_path) == step_losses(k4_run[0])  # bitwise: same floats, same order


def test_cli_resume_with_another_k_keeps_the_data_position(k1_run, shakespeare, tmp_path):
    """Steps 1-4 at K=1, then 5-12 at K=4: the same rows in the same order, so the same losses."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(k1_run[0], run_dir)
    for step in ("8", "12"):
        shutil.rmtree(run_dir / "checkpoints" / step)
    r = run_cli("train.py", *train_args(run_dir, shakespeare, "--train.steps_per_call=4"), devices=1)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout
    np.testing.assert_allclose(step_losses(run_dir), step_losses(k1_run[0]), rtol=0, atol=1e-5)
    other = run_cli("train.py", *train_args(run_dir, shakespeare, "--train.seq_len=16", "--train.steps=16"),
                    devices=1)
    assert other.returncode != 0
    assert "checkpoint was trained with train.seq_len=32, this run has 16" in other.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("source, devices", [("k4_run", 1), ("k1_run", 8)])
def test_cli_eval_on_other_device_counts_matches(request, source, devices):
    run_dir, _ = request.getfixturevalue(source)
    results = {}
    for n in (devices, 8 if devices == 1 else 1):
        out = run_dir / f"eval-{n}.json"
        r = run_cli("eval.py", "--run_dir", str(run_dir), "--batches", "4", "--out", str(out), "--no-wandb",
                    devices=n)
        assert r.returncode == 0, r.stderr[-3000:]
        results[n] = json.loads(out.read_text())["12"]["val_loss"]
    assert abs(results[1] - results[8]) <= 1e-5


def test_cli_eval_all_checkpoints_and_sample(k4_run):
    run_dir, _ = k4_run
    r = run_cli("eval.py", "--run_dir", str(run_dir), "--all", "--batches", "2", "--prompt", "KING:",
                "--max_new_tokens", "5", "--temperature", "0")
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads((run_dir / "eval.json").read_text())
    assert sorted(results, key=int) == ["4", "8", "12"]
    assert results["4"]["val_loss"] > results["12"]["val_loss"]
    assert r.stdout.count("KING:") == 3


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model.n_layr=2"], "unknown config key --model.n_layr (did you mean model.n_layer?); valid keys"),
        (["--train.batch_size=many"], "--train.batch_size"),
        (["--model.dtype=float8"], "float8"),
        (["--model.n_head=3"], "model.n_head=3 must divide model.n_embd=32"),
        (["--train.steps=0"], "train.steps must be positive"),
        (["--train.seq_len=128"], "train.seq_len=128 exceeds model.block_size=64"),
        (["--mesh.data=3"], "mesh data×fsdp×tensor = 3×1×1 = 3 but there are 8 devices"),
        (["--mesh.rules=zero3"], "unknown sharding rules preset 'zero3'"),
        (["--train.batch_size=6"], "not divisible by the data-parallel size mesh.data×mesh.fsdp = 8"),
        (["--data.dataset=/nonexistent"], "/nonexistent: dataset directory does not exist"),
    ],
)
def test_cli_config_errors_are_one_line(tmp_path, shakespeare, args, message):
    r = run_cli("train.py", "--run_dir", str(tmp_path / "run"), f"--data.cache_dir={shakespeare}", *SMALL, *args)
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, r.stderr[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_cli_refuses_a_checkpoint_of_another_model(k4_run, shakespeare):
    r = run_cli("train.py", "--run_dir", str(k4_run[0]), f"--data.cache_dir={shakespeare}", *SMALL,
                "--model.n_layer=3", "--train.steps=16")
    assert r.returncode == 2
    assert "checkpoint does not fit this model: model.n_layer: checkpoint 2 vs config 3" in r.stderr


def test_train_call_compiles_once_and_holds_no_materialized_mask():
    """Regression guards that time nothing: no recompiles between calls; causal masking stays implicit."""
    cfg = dataclasses.replace(NANO_RUN, train=dataclasses.replace(NANO_RUN.train, steps_per_call=2))
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    trainer = Trainer.build(cfg, mesh)
    with jax.set_mesh(mesh):
        call = trainer.train_call()
        state = trainer.init_state()
        for i in range(3):  # fresh batches, same shapes: one executable serves them all
            batch = np.random.RandomState(i).randint(0, 96, (2, 8, 17)).astype(np.int32)
            state, _ = call(state, jax.device_put(batch, trainer.batch_sharding))
        assert call._cache_size() == 1
        hlo = call.lower(trainer.abstract_state(), jax.ShapeDtypeStruct((2, 8, 17), jnp.int32,
                                                                        sharding=trainer.batch_sharding)).as_text()
    T = 16
    constants = [line for line in hlo.splitlines() if "constant" in line and f"{T}x{T}x" in line.replace(",", "x")]
    assert not constants, constants[:3]


@pytest.mark.parametrize("rules, mesh_shape", [("fsdp", (2, 4, 1)), ("fsdp_tp", (2, 2, 2))])
def test_sharded_train_call_never_replicates_activations(capfd, rules, mesh_shape):
    """The SPMD partitioner logs "Involuntary full rematerialization" when it can only reshard a tensor by
    replicating it whole (it did for the embedding lookup: embed-sharded rows vs batch-sharded activations)."""
    cfg = dataclasses.replace(NANO_RUN, mesh=dataclasses.replace(NANO_RUN.mesh, rules=rules))
    mesh = make_mesh(*mesh_shape, devices=jax.devices())
    trainer = Trainer.build(cfg, mesh)
    batch = jax.ShapeDtypeStruct((1, 8, 17), jnp.int32, sharding=trainer.batch_sharding)
    capfd.readouterr()
    with jax.set_mesh(mesh):
        trainer.train_call().lower(trainer.abstract_state(), batch).compile()
    log = capfd.readouterr().err
    assert "Involuntary full rematerialization" not in log, log[:2000]


def test_cli_eval_of_hugging_face_weights(tmp_path, shakespeare):
    transformers = pytest.importorskip("transformers")
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=64, n_embd=32, n_layer=2, n_head=2)
                                 ).save_pretrained(tmp_path / "hf")
    out = tmp_path / "hf.json"
    r = run_cli("eval.py", "--hf", str(tmp_path / "hf"), "--dataset", str(shakespeare), "--batches", "2",
                "--seq_len", "32", "--out", str(out), "--prompt", "KING:", "--max_new_tokens", "4", devices=2)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())["hf"]
    assert result["batches"] == 2 and abs(result["val_loss"] - np.log(50257)) < 0.5  # random init: ~uniform
    assert "KING:" in r.stdout


_HEAP_PROBE = """
import ctypes, sys
from trainer.host import keep_freed_memory
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
