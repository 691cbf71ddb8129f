"""Several JAX processes on this machine (CPU collectives over 127.0.0.1), as on a multi-host pod: two processes equal
one, their checkpoints resume on another mesh, a signal saves everywhere at one step, and one process's error ends
both. Stalls and missing processes: tests/e2e/test_stalls.py."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import train as train_app
from support.cli import ROOT, private_compile_cache, rewound, run_main
from tools.launch import free_port
from support.processes import COMMON, checkpoints_of, end_both, losses, start_processes, wait_for_steps


def launch(run_dir, shakespeare, *extra, num_processes=2, devices=4, timeout=600):
    cmd = [sys.executable, "-m", "tools.launch", "--num_processes", str(num_processes), "--devices_per_process",
           str(devices), "--grace", "20", "--", sys.executable, "train.py", "--run_dir", str(run_dir),
           f"--data.cache_dir={shakespeare}", *COMMON, *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, shakespeare):
    run_dir = tmp_path_factory.mktemp("mp")
    r = launch(run_dir, shakespeare)
    assert r.returncode == 0, r.stdout[-3000:]
    return run_dir, r


def sample_of(output: str) -> str:
    text = output.replace("[p0] ", "")
    start = text.index("--- sample ---\n")
    return text[start:text.index("\n--------------\n", start)]


def test_two_processes_equal_one(two_process_run, shakespeare, tmp_path):
    run_dir, result = two_process_run
    code, out, err = run_main(train_app.main, "--run_dir", str(tmp_path), f"--data.cache_dir={shakespeare}", *COMMON)
    assert code == 0, err[-3000:]
    np.testing.assert_allclose(losses(run_dir), losses(tmp_path), rtol=0, atol=1e-5)
    assert len(losses(run_dir)) == 8
    # the default end-of-run sample: the same text from 2 processes as from 1, printed once
    assert sample_of(result.stdout) == sample_of(out) and "ROMEO:" in sample_of(out)
    assert result.stdout.count("--- sample ---") == 1
    # only process 0 reports: one parameter report, one set of metrics
    assert result.stdout.count("[p0] step 4: val_loss") == 1 and "[p1] step 4: val_loss" not in result.stdout
    assert "[p1] model    " not in result.stdout and "[p0] model    " in result.stdout  # the start-up summary
    # both processes wrote their own data-iterator state into the checkpoint
    data = sorted(p.name for p in (run_dir / "checkpoints" / "8" / "data").glob("process_*"))
    assert data == ["process_0-of-2.json", "process_1-of-2.json"]


def test_two_process_checkpoint_resumes_in_one_process_on_another_mesh(two_process_run, shakespeare, tmp_path):
    reference, _ = two_process_run
    run_dir = rewound(reference, tmp_path, 4)  # as the two processes left it at their checkpoint 4
    code, out, err = run_main(train_app.main, "--run_dir", str(run_dir), f"--data.cache_dir={shakespeare}", *COMMON,
                              "--mesh.fsdp=1", "--mesh.rules=dp")  # data 8: another mesh, replicated params
    assert code == 0, err[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / '4'}" in out
    np.testing.assert_allclose(losses(run_dir), losses(reference), rtol=0, atol=1e-5)


def test_init_from_on_two_processes_reads_each_ones_shards_bitwise_as_one_process(tmp_path):
    """`--init_from` as train.py loads it (benchmarks/init_from.py runs trainer.run.init_from.load_params), fsdp and
    tensor parallel over 2 processes × 4 devices: every shard is bitwise the one a single process of 8 devices
    loads, and each process reads and holds about half of the parameters."""
    from flax import nnx

    from gpt2 import GPT2, GPT2Config, to_hf

    hf = tmp_path / "hf"  # 200 tokens: the vocabulary's padding rows fall in the second tensor shard
    to_hf(GPT2(GPT2Config(vocab_size=200, block_size=128, n_layer=2, n_head=4, n_embd=64), rngs=nnx.Rngs(0)), hf)
    records = {}
    for n in (2, 1):
        r = subprocess.run([sys.executable, "-m", "benchmarks.init_from", "--hf", str(hf), "--processes", str(n),
                            "--out", str(tmp_path / str(n)), "--mesh.data=1", "--mesh.fsdp=4", "--mesh.tensor=2",
                            "--mesh.rules=fsdp_tp", "--model.pad_vocab_to=128"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        records[n] = [json.loads((tmp_path / str(n) / f"process_{i}.json").read_text()) for i in range(n)]
    two, (one,) = records[2], records[1]
    assert {**two[0]["shards"], **two[1]["shards"]} == one["shards"]
    both = {key.split("[")[0].split("/")[-1] for key in set(two[0]["shards"]) & set(two[1]["shards"])}
    assert both == {"bias"}  # only what fsdp leaves whole (biases without an embed dim) is read by both
    assert two[0]["held_bytes"] + two[1]["held_bytes"] == one["held_bytes"]
    assert one["read_bytes"] == one["held_bytes"] - 4 * (256 - 200) * 64  # every element once; the padding unread
    for process in two:  # its own shards: the file once between them, plus the biases both hold
        assert process["read_bytes"] < 0.52 * one["read_bytes"] and process["held_bytes"] < 0.52 * one["held_bytes"]


def test_sigterm_to_one_process_saves_everywhere_at_one_step_and_resumes(two_process_run, shakespeare, tmp_path):
    """SIGTERM reaches process 1 only (a preempted host): JAX's preemption sync point makes both processes
    stop after the same call, save it together and exit 0."""
    procs = start_processes(tmp_path, shakespeare, stderr=subprocess.STDOUT)
    wait_for_steps(tmp_path, 4, procs[0])
    procs[1].send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    assert "stopped by SIGTERM at step" in outs[0]
    steps = [int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]
    assert len(steps) == 1 and 4 <= steps[0] < 400
    data = sorted(p.name for p in (tmp_path / "checkpoints" / str(steps[0]) / "data").glob("process_*"))
    assert data == ["process_0-of-2.json", "process_1-of-2.json"]
    # the restart (one process here, in-process: any process count resumes) continues from that step with the
    # losses of an uninterrupted run of as many steps (the 8-step 2-process run, or, when the signal landed
    # later, a 1-process run)
    total = max(8, steps[0] + 2)
    code, out, err = run_main(train_app.main, "--run_dir", str(tmp_path), f"--data.cache_dir={shakespeare}", *COMMON,
                              f"--train.steps={total}", "--train.sample_tokens=0")
    assert code == 0 and "resumed from" in out, err[-3000:]
    if total == 8:
        expected = losses(two_process_run[0])
    else:
        code, _, err = run_main(train_app.main, "--run_dir", str(tmp_path / "ref"), f"--data.cache_dir={shakespeare}",
                                *COMMON, f"--train.steps={total}", "--train.eval_every=0")
        assert code == 0, err[-3000:]
        expected = losses(tmp_path / "ref")
    np.testing.assert_allclose(losses(tmp_path), expected, rtol=0, atol=1e-5)


# ---- one process fails, the job ends -------------------------------------------------------------------


@contextlib.contextmanager
def read_only_but_checkpoints(run_dir, alias):
    """From now on no new file can be made in `run_dir` (a read-only bind mount over it, as a location that
    turned read-only), while files already open stay writable and `checkpoints/` stays writable (bound back
    from `alias`, a second view of the original directory). Root only: root ignores file modes."""
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only directory needs root")
    alias.mkdir()
    mounts = [["--bind", str(run_dir), str(alias)], ["--bind", str(run_dir), str(run_dir)],
              ["-o", "remount,bind,ro", str(run_dir)],
              ["--bind", str(alias / "checkpoints"), str(run_dir / "checkpoints")]]
    for m in mounts:
        subprocess.run(["mount", *m], check=True)
    try:
        yield
    finally:
        for target in (run_dir / "checkpoints", run_dir, alias):
            subprocess.run(["umount", "--lazy", str(target)], check=True)


def limit_file_size(proc, run_dir, room: int) -> None:
    """From now on no file of `proc` may grow past the largest file in run_dir plus `room` bytes (RLIMIT_FSIZE
    is per file): room for the logs' next lines, not for a checkpoint's arrays (~100 KB)."""
    largest = max(p.stat().st_size for p in run_dir.iterdir() if p.is_file())
    subprocess.run(["prlimit", f"--pid={proc.pid}", f"--fsize={largest + room}"], check=True)


@pytest.mark.parametrize("fault", ["plot", "save"])
def test_a_storage_error_on_process_0_ends_both_processes_in_seconds(shakespeare, tmp_path, fault):
    """Process 0 alone meets a storage error mid-run while process 1 is already inside the next call's
    collectives: the run directory turns read-only at the next loss.png, or a file-size limit (as a full
    disk) stops the next checkpoint's arrays. Both end within seconds, one line each."""
    run_dir = tmp_path / "run"
    procs = start_processes(run_dir, shakespeare, "--checkpoint.every=4", "--checkpoint.keep=10",
                            *(["--train.eval_every=4"] if fault == "plot" else []),
                            # the size limit would also cut the compilation cache's writes short
                            env=private_compile_cache(tmp_path) if fault == "save" else None)
    wait_for_steps(run_dir, 6, procs[0])
    with contextlib.ExitStack() as stack:
        if fault == "plot":
            stack.enter_context(read_only_but_checkpoints(run_dir, tmp_path / "alias"))
        else:
            limit_file_size(procs[0], run_dir, room=16_384)
        faulted = time.time()
        errs, spread = end_both(procs)
    print(f"{fault}: both ended {time.time() - faulted:.1f} s after the fault, {spread:.2f} s apart")
    assert [p.returncode for p in procs] == [2, 2], errs
    assert [len(e.strip().splitlines()) for e in errs] == [1, 1], errs  # no traceback on either
    cause = (f"cannot write {run_dir / 'loss.png'}: Read-only file system" if fault == "plot"
             else f"could not save checkpoint in {run_dir / 'checkpoints'}: ")
    assert errs[0].startswith(f"error: {cause}"), errs[0]
    assert errs[1].startswith(f"error: process 0 failed ({cause}"), errs[1]
    assert errs[1].strip().endswith("; process 1 stops with it"), errs[1]
    assert spread < 5 and time.time() - faulted < 45, (spread, time.time() - faulted)
    if fault == "plot":
        return
    # nothing saved is damaged: the newest checkpoint restores (one process here), and the failed save's
    # temporary directory is cleaned away at the start
    assert any("tmp" in p.name for p in (run_dir / "checkpoints").iterdir())
    newest = checkpoints_of(run_dir)[-1]
    code, out, err = run_main(train_app.main, "--run_dir", str(run_dir), f"--data.cache_dir={shakespeare}", *COMMON,
                              "--train.steps=400", f"--train.stop_after={newest + 2}", "--train.eval_every=0",
                              "--checkpoint.every=1000", "--train.sample_tokens=0")
    assert code == 0 and f"resumed from {run_dir / 'checkpoints' / str(newest)}\n" in out, err[-3000:]
    assert [p.name for p in (run_dir / "checkpoints").iterdir() if "tmp" in p.name] == []


JOB = """
import sys, time
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from configs.base import DistributedConfig
from errors import StorageError, one_line_errors
from trainer.processes import failing_together, initialize_distributed

@one_line_errors
def main(failer):
    initialize_distributed(DistributedConfig())
    with failing_together():
        mesh = jax.make_mesh((jax.device_count(),), ("d",))
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), np.ones((2, 64), np.float32))
        step = jax.jit(lambda x: (x.sum(), x * 1.0))
        pending = None
        for i in range(10**6):
            total, x = step(x)  # dispatched before the previous call's result is read, as the loop does
            if pending is not None:
                float(pending)  # the other process waits here for the failed one
            pending = total
            if jax.process_index() == failer and i == 20:
                print("failing", time.time(), flush=True)
                raise StorageError("cannot write /x/metrics.jsonl: File too large")

sys.exit(main(int(sys.argv[1])))
"""


@pytest.mark.parametrize("failer", [0, 1])
def test_an_error_on_either_process_ends_both_in_one_line_each(tmp_path, failer):
    """The job-wide failure protocol alone (no training): the failing process raises while the other has
    dispatched the next call and waits inside its collective."""
    port, procs = free_port(), []
    for pid in range(2):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
               "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(pid)}
        procs.append(subprocess.Popen([sys.executable, "-c", JOB, str(failer)], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    ended = time.time()
    failed_at = float(outs[failer][0].split()[-1])
    errs = [e for _, e in outs]
    assert [p.returncode for p in procs] == [2, 2], errs
    assert [len(e.strip().splitlines()) for e in errs] == [1, 1], errs
    cause = "cannot write /x/metrics.jsonl: File too large"
    other = 1 - failer
    assert errs[failer] == f"error: {cause}\n"
    assert errs[other] == f"error: process {failer} failed ({cause}); process {other} stops with it\n"
    assert ended - failed_at < 5, ended - failed_at
