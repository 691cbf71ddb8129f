"""A process of a two-process job that dies, freezes, blocks in a data read, or never comes: every other process ends
in bounded time, one line each naming what happened (the heartbeat, the stall watchdog, the start-up bound), and
the run resumes. Split from tests/e2e/test_multiprocess.py so the two files run on separate workers: these mostly
wait on timeouts."""

import os
import re
import signal
import subprocess
import sys
import time

import train as train_app
from support.cli import ROOT, run_main
from tools.launch import free_port
from support.processes import COMMON, checkpoints_of, end_both, start_processes, wait_for_steps

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



# what a program in tmp_path that imports train.py needs on its path (and the tests' sitecustomize)
WRAPPER_PYTHONPATH = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ["PYTHONPATH"]])}

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
                            env={"DEAD_DISK": str(fifo), **WRAPPER_PYTHONPATH})
    errs, spread = end_both(procs, timeout=400)
    assert [p.returncode for p in procs] == [2, 2], errs
    for i, err in enumerate(errs):
        assert len(err.strip().splitlines()) == 1, err
        assert "stalled: no train call finished on process" in err and f"stacks.{i}.txt" in err, err
    assert spread < 8, spread
    stacks = (run_dir / "logs" / "stacks.1.txt").read_text()
    assert "in read_window_from_a_dead_disk" in stacks and "in next_batches" in stacks, stacks



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
                            env={"DEAD_DISK": str(fifo), **WRAPPER_PYTHONPATH})
    errs, spread = end_both(procs, timeout=300)
    assert [p.returncode for p in procs] == [2, 2], errs
    late = ("start-up: process 1 did not come to its first train call within 45 s of the job forming"
            " (--distributed.startup_timeout_seconds); the other processes did")
    assert errs == [f"error: {late}\n", f"error: process 0 failed ({late}); process 1 stops with it\n"], errs
    assert spread < 8, spread

