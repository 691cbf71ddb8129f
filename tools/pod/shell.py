"""The launch's commands, run as --dry_run prints them (bash): echoed, their output passed through and its tail kept,
a failed step on the hosts tried again with backoff, and a step that fails for good reported in one line that
names the hosts gcloud says failed and the last thing they said."""

from __future__ import annotations

import re
import subprocess
import sys
import time

from errors import UserError

# gcloud's `tpu-vm ssh` / `queued-resources ssh` on several workers: one line per failed worker, then its own exit
# with that status (command_lib/compute/tpus/tpu_vm/ssh.py, AttemptRunWithRetries and WaitForBatchCompletion)
WORKER_FAILED = re.compile(r"##### Command execution on worker (\d+) failed with exit status (\d+)")
TAIL = 40  # lines of a command's output kept for its error message


class StepFailed(UserError):
    pass


def shell(command: str) -> subprocess.CompletedProcess:
    """Runs a command in the foreground, echoing it first; its output goes straight to the terminal."""
    print(f"$ {command}", flush=True)
    return subprocess.run(["bash", "-c", command], check=False)


def quietly(command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, check=False)


def echoed(command: str) -> tuple[int, list[str]]:
    """Runs a command, echoing it and passing its output (stdout and stderr, merged) through; returns its status and
    the tail of its output."""
    print(f"$ {command}", flush=True)
    proc = subprocess.Popen(["bash", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace")
    tail: list[str] = []
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        tail = (tail + [line.rstrip("\n")])[-TAIL:]
    return proc.wait(), tail


def must(command: str, what: str, *, tries: int = 1, backoff_seconds: float = 10.0) -> None:
    """Runs the command until it succeeds, at most `tries` times, waiting `backoff_seconds`, then twice that, ...
    between tries (a package index that answers 503, an ssh that drops: transient); raises StepFailed, one line,
    after the last."""
    for attempt in range(1, tries + 1):
        code, tail = echoed(command)
        if code == 0:
            return
        failure = describe(code, tail)
        if attempt < tries:
            wait = backoff_seconds * 2 ** (attempt - 1)
            print(f"{what} failed ({failure}); trying again in {wait:g} s ({attempt + 1} of {tries})", flush=True)
            time.sleep(wait)
    after = f" after {tries} tries" if tries > 1 else ""
    raise StepFailed(f"{what} failed{after} ({failure})")


def describe(code: int, tail: list[str]) -> str:
    """A failed command in a few words: which workers failed with which status (gcloud's ssh names them), and the
    last line of output that is not gcloud's own bookkeeping."""
    workers = [m.groups() for m in map(WORKER_FAILED.search, tail) if m]
    said = next((line.strip() for line in reversed(tail) if line.strip() and not WORKER_FAILED.search(line)
                 and not line.startswith(("SSH: Attempting", "Using ssh batch size"))), "")
    who = (f"worker{'s' if len(workers) > 1 else ''} {', '.join(w for w, _ in workers)} exited"
           f" {', '.join(sorted({s for _, s in workers}))}" if workers else f"exit status {code}")
    return who + (f": {said[:200]}" if said else "")
