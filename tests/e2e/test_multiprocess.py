"""Several JAX processes on this machine (CPU collectives over 127.0.0.1), as on a multi-host pod."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import train as train_app
from support.cli import ROOT, SMALL, read_jsonl, run_main
from tools.launch import free_port

# The default end-of-run sample is on (it runs on every process: the parameters span them all).
COMMON = [*SMALL, "--train.steps=8", "--train.eval_every=4", "--checkpoint.every=4", "--mesh.fsdp=2",
          "--train.sample_tokens=12"]


def launch(run_dir, shakespeare, *extra, num_processes=2, devices=4, timeout=600):
    cmd = [sys.executable, "-m", "tools.launch", "--num_processes", str(num_processes), "--devices_per_process",
           str(devices), "--grace", "20", "--", sys.executable, "train.py", "--run_dir", str(run_dir),
           f"--data.cache_dir={shakespeare}", *COMMON, *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def losses(run_dir):
    return [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


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
    first = launch(tmp_path, shakespeare, "--train.stop_after=4")
    assert first.returncode == 0, first.stdout[-3000:]
    code, out, err = run_main(train_app.main, "--run_dir", str(tmp_path), f"--data.cache_dir={shakespeare}", *COMMON,
                              "--mesh.fsdp=1", "--mesh.rules=dp")  # data 8: another mesh, replicated params
    assert code == 0, err[-3000:]
    assert "resumed from" in out
    np.testing.assert_allclose(losses(tmp_path), losses(reference), rtol=0, atol=1e-5)


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
                            "--mesh.rules=fsdp_tp", "--model.pad_vocab_to=128"], cwd=ROOT, capture_output=True, text=True, timeout=300)
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


def start_processes(run_dir, shakespeare, *extra, stderr=subprocess.PIPE, env=None, program="train.py"):
    """Two train.py processes (or `program`'s, which runs train.py) of one job started directly (no launcher to
    forward signals)."""
    port, procs, extra_env = free_port(), [], env or {}
    for pid in range(2):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
               "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(pid),
               **extra_env}
        procs.append(subprocess.Popen(
            [sys.executable, str(program), "--run_dir", str(run_dir), f"--data.cache_dir={shakespeare}", *COMMON,
             "--train.steps=400", "--train.eval_every=0", "--checkpoint.every=1000", "--train.sample_tokens=0",
             *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True))
    return procs


def wait_for_steps(run_dir, n, proc):
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= n):
        assert time.time() < deadline and proc.poll() is None, "training did not start"
        time.sleep(0.2)


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


def test_a_dead_process_makes_the_others_fail_in_bounded_time(shakespeare, tmp_path):
    procs = start_processes(tmp_path, shakespeare, "--distributed.heartbeat_timeout_seconds=10")
    wait_for_steps(tmp_path, 2, procs[0])
    procs[1].kill()
    killed = time.time()
    try:
        procs[0].wait(timeout=120)
    finally:
        procs[0].kill()
    assert procs[0].returncode != 0
    assert time.time() - killed < 120


# ---- one process fails, the job ends -------------------------------------------------------------------


def checkpoints_of(run_dir):
    ckpt = run_dir / "checkpoints"
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) if ckpt.exists() else []


def end_both(procs, timeout=60):
    """(stderr of each, seconds from the first exit to the last) once both processes have ended."""
    ended, deadline = {}, time.time() + timeout
    while len(ended) < 2 and time.time() < deadline:
        for i, p in enumerate(procs):
            if i not in ended and p.poll() is not None:
                ended[i] = time.time()
        time.sleep(0.05)
    for p in procs:
        p.kill()
    errs = [p.communicate()[1] for p in procs]
    assert len(ended) == 2, f"not every process ended within {timeout} s:\n" + "\n".join(e[-2000:] for e in errs)
    return errs, max(ended.values()) - min(ended.values())


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
                            env={"JAX_ENABLE_COMPILATION_CACHE": "false"})  # no truncated cache entries
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


# ---- a stalled process ends the job -----------------------------------------------------------------------

STALL_FLAGS = ["--distributed.stall_timeout_seconds=20", "--distributed.heartbeat_timeout_seconds=300",
               "--checkpoint.every=4", "--checkpoint.keep=10"]


def test_a_frozen_process_ends_the_other_within_the_stall_timeout_and_the_run_resumes(shakespeare, tmp_path):
    """Process 1's host is frozen (SIGSTOP) mid-run and the heartbeat would wait 300 s: process 0, waiting
    for it in a collective, ends within the stall timeout plus the 5 s it gives the others to hear of it, in
    one line naming its stacks; the restart resumes from the newest checkpoint. (3.5 min on the shared 2-core
    machine, load ~14)"""
    run_dir = tmp_path / "run"
    procs = start_processes(run_dir, shakespeare, *STALL_FLAGS)
    wait_for_steps(run_dir, 6, procs[0])
    while not checkpoints_of(run_dir):  # a finished save: the restart has something to resume
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGSTOP)
    frozen = time.time()
    try:
        err = procs[0].communicate(timeout=120)[1]
    finally:
        procs[1].kill()
        procs[1].communicate()
    took = time.time() - frozen
    stacks = run_dir / "logs" / "stacks.0.txt"
    assert procs[0].returncode == 2, err[-3000:]
    line = ("error: stalled: no train call finished on process 0 for {} s (--distributed.stall_timeout_seconds:"
            f" 20 s); every thread's stack is in {stacks}")
    assert re.fullmatch(re.escape(line).replace(r"\{\}", r"\d+"), err.strip()), err[-3000:]  # one line
    assert took < 20 + 5 + 10, took
    assert "in run_calls" in stacks.read_text()  # the main thread, wherever the loop waits for process 1
    newest = checkpoints_of(run_dir)[-1]
    code, out, err = run_main(train_app.main, "--run_dir", str(run_dir), f"--data.cache_dir={shakespeare}", *COMMON,
                              "--train.steps=400", f"--train.stop_after={newest + 2}", "--train.eval_every=0",
                              "--checkpoint.every=1000")
    assert code == 0 and f"resumed from {run_dir / 'checkpoints' / str(newest)}\n" in out, err[-3000:]
    assert len(stacks.read_text().splitlines()) > 3  # the stall's stacks outlive the restart


DEAD_DISK = """
import os, sys
import data.loader, train

read_window, reads = data.loader.TokenWindows.__getitem__, [0]


def read_window_from_a_dead_disk(self, index):
    reads[0] += 1
    if os.environ["JAX_PROCESS_ID"] == "1" and reads[0] > 120:  # ~15 calls in, well past the start-up
        open(os.environ["DEAD_DISK"]).read()  # a FIFO nobody writes: blocks in the kernel, as a hung mount
    return read_window(self, index)


data.loader.TokenWindows.__getitem__ = read_window_from_a_dead_disk
sys.exit(train.main())
"""


def test_a_data_read_that_never_returns_ends_both_processes_with_the_read_on_file(shakespeare, tmp_path):
    """Process 1's data read blocks forever while process 0 waits for it in a collective: both end in one line
    each naming the stall and their stacks, and process 1's stacks show the read. (1-3 min there)"""
    run_dir, program, fifo = tmp_path / "run", tmp_path / "dead_disk.py", tmp_path / "dead_disk"
    program.write_text(DEAD_DISK)
    os.mkfifo(fifo)
    procs = start_processes(run_dir, shakespeare, *STALL_FLAGS, program=program,
                            env={"DEAD_DISK": str(fifo), "PYTHONPATH": str(ROOT)})
    errs, spread = end_both(procs, timeout=400)
    assert [p.returncode for p in procs] == [2, 2], errs
    for i, err in enumerate(errs):
        assert len(err.strip().splitlines()) == 1, err
        assert "stalled: no train call finished on process" in err and f"stacks.{i}.txt" in err, err
    assert spread < 8, spread
    stacks = (run_dir / "logs" / "stacks.1.txt").read_text()
    assert "in read_window_from_a_dead_disk" in stacks and "in next_batches" in stacks, stacks


# ---- a process missing at the start -------------------------------------------------------------------------

JOIN = """
import sys, time
from configs.base import DistributedConfig
from errors import one_line_errors
from trainer.processes import initialize_distributed

@one_line_errors
def main():
    print(time.time(), flush=True)  # joining from now
    initialize_distributed(DistributedConfig(initialization_timeout=int(sys.argv[1])))
    return 0

sys.exit(main())
"""


def test_a_process_that_never_starts_is_named_by_every_process_that_did(tmp_path):
    """Process 2 of 3 never starts: processes 0 and 1 end 8 s (--distributed.initialization_timeout) after process
    0 began to join, exit 2, in the same one line naming process 2 (before the roll-call: SIGABRT, exit 134, a
    C++ stack naming nobody). A process whose process 0 never starts says that the coordinator did not answer."""
    def join(port, pid, n):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
               "JAX_NUM_PROCESSES": str(n), "JAX_PROCESS_ID": str(pid)}
        return subprocess.Popen([sys.executable, "-c", JOIN, "8"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    port, lonely_port = free_port(), free_port()
    procs = [join(port, 0, 3), join(port, 1, 3), join(lonely_port, 1, 2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        outs.append((time.time() - float(out.split()[0]), err))
    assert [p.returncode for p in procs] == [2, 2, 2], outs
    named = ("error: the job did not form: process 2 of 3 did not check in within 8 s of process 0's start"
             " (--distributed.initialization_timeout): not started, or unable to reach process 0\n")
    assert [err for _, err in outs[:2]] == [named, named]
    assert outs[2][1] == (f"error: the job did not form: process 0 (the coordinator, 127.0.0.1:{lonely_port}) did"
                          " not answer process 1 within 8 s (--distributed.initialization_timeout): it did not start,"
                          " or this host cannot reach it\n")
    assert 8 <= outs[0][0] < 8 + 15 and all(took < 8 + 15 for took, _ in outs), outs  # (15: exits under load)


STUCK = """
import os, sys
import data.loader, train

read_window = data.loader.TokenWindows.__getitem__


def read_window_from_a_dead_disk_on_process_1(self, index):
    if os.environ["JAX_PROCESS_ID"] == "1":
        open(os.environ["DEAD_DISK"]).read()  # a FIFO nobody writes: its first read never returns
    return read_window(self, index)


data.loader.TokenWindows.__getitem__ = read_window_from_a_dead_disk_on_process_1
sys.exit(train.main())
"""


def test_a_process_stuck_before_its_first_call_is_named_by_every_process(shakespeare, tmp_path):
    """Process 1 never gets its first batch: within --distributed.startup_timeout_seconds of the job forming,
    both processes end in one line naming process 1 (before: process 0 waited in the first call's collectives,
    or, on CPU collectives, died after 30 s with a CoordinationServiceError traceback)."""
    run_dir, program, fifo = tmp_path / "run", tmp_path / "stuck.py", tmp_path / "dead_disk"
    program.write_text(STUCK)
    os.mkfifo(fifo)
    procs = start_processes(run_dir, shakespeare, "--distributed.startup_timeout_seconds=45", program=program,
                            env={"DEAD_DISK": str(fifo), "PYTHONPATH": str(ROOT)})
    errs, spread = end_both(procs, timeout=300)
    assert [p.returncode for p in procs] == [2, 2], errs
    late = ("start-up: process 1 did not come to its first train call within 45 s of the job forming"
            " (--distributed.startup_timeout_seconds); the other processes did")
    assert errs == [f"error: {late}\n", f"error: process 0 failed ({late}); process 1 stops with it\n"], errs
    assert spread < 8, spread
