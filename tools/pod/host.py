"""The training on a host, as the launcher starts it.

    python -m tools.pod.host start --job NAME --run_dir DIR -- .venv/bin/python train.py ...   # returns at once
    python -m tools.pod.host state --job NAME    # running, the exit status, lost (ended unrecorded), or none
    python -m tools.pod.host stop --job NAME     # kills what is left of it (before a restart on these hosts)
    python -m tools.pod.host train --run_dir DIR -- .venv/bin/python train.py ...   # in the foreground

`start` (a TPU VM) leaves the command to a supervisor in its own session (setsid) that ignores SIGHUP (nohup): a
dropped ssh connection, the launcher's or a laptop's, no longer ends the training, and `gcloud ... ssh
--worker=all` returns on every host at once (its batches of --batch-size hosts no longer wait on each other's
training). The supervisor records its pid and, when the command ends, its exit status in ~/gpt2-nnx-job/ (what
`state` reads for the launcher's keep-alive), and keeps the command's output in the run directory:
<run_dir>/logs/console.<host>.log as it is written, or for a gs:// run directory ~/gpt2-nnx-job/NAME.log, copied
to the bucket every 30 s while it runs (so a lost VM loses at most the last 30 s) and when it ends. `train` (a
container, a Slurm task) runs the command in the foreground.

Both report a saved preemption as 42 (PREEMPTED), not the 0 train.py ends it with: every pod exiting 0 makes a
JobSet Completed (never restarted), a Slurm job COMPLETED, a TPU VM's record "finished". 42 is the status xpk's
JobSet restarts on by default, and the one the launcher relaunches on. Standard library only (plus etils for a
gs:// run directory): `state` runs once per poll.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

JOBS = "gpt2-nnx-job"  # in the host's home: each job's pid, exit status and (gs:// run directories) log
PREEMPTED = 42  # a saved preemption: "start me again" (xpk's default restart status; tools/pod/targets.py)
LOG_EVERY_S = 30.0  # a gs:// console log is copied this often while the command runs


def files(job: str) -> tuple[Path, Path]:
    """The job's pid file and exit-status file."""
    d = Path.home() / JOBS
    return d / f"{job}.pid", d / f"{job}.exit"


def console_log(job: str, run_dir: str) -> Path:
    """Where the command's output goes while it runs."""
    if run_dir.startswith("gs://"):
        return Path.home() / JOBS / f"{job}.log"
    return Path(run_dir) / "logs" / f"console.{host_name()}.log"


def console_object(run_dir: str) -> str:
    """A gs:// run directory's copy of this host's console log."""
    return f"{run_dir.rstrip('/')}/logs/console.{host_name()}.log"


def host_name() -> str:
    return os.environ.get("HOSTNAME") or socket.gethostname()  # HOSTNAME: exported where several share a kernel


def start(job: str, run_dir: str, command: list[str], log_every: float = LOG_EVERY_S) -> int:
    pid, status = files(job)
    pid.parent.mkdir(parents=True, exist_ok=True)
    status.unlink(missing_ok=True)
    supervisor = subprocess.Popen([sys.executable, "-m", "tools.pod.host", "run", "--job", job, "--run_dir", run_dir,
                                   f"--log_every={log_every:g}", "--", *command], start_new_session=True,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pid.write_text(str(supervisor.pid))  # its session's id: `stop` ends the whole group
    print(f"started {job} (pid {supervisor.pid}); its output: {console_log(job, run_dir)}", flush=True)
    return 0


def run(job: str, run_dir: str, command: list[str], log_every: float = LOG_EVERY_S) -> int:
    """The supervisor: runs the command to its end, then records its exit status (128 + N for signal N; 42 for
    a saved preemption)."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup
    log = console_log(job, run_dir)
    log.parent.mkdir(parents=True, exist_ok=True)
    mirror = LogMirror(log, console_object(run_dir), log_every) if run_dir.startswith("gs://") else None
    if mirror is not None:
        mirror.resume()
    started = time.time()
    with open(log, "a") as out:
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    for s in (signal.SIGTERM, signal.SIGINT):  # a VM's shutdown or a maintenance event: the trainer saves
        signal.signal(s, lambda signum, frame: child.send_signal(signum))
    if mirror is not None:
        mirror.start()
    code = resumable(child.wait(), run_dir, started)
    if mirror is not None:
        mirror.finish()
    _, status = files(job)
    status.with_suffix(".tmp").write_text(f"{code}\n")
    status.with_suffix(".tmp").replace(status)  # whole or absent: `state` never reads half a number
    return code


def train(run_dir: str, command: list[str]) -> int:
    """The command in the foreground, its output passed through, its status as `resumable` reads it."""
    started = time.time()
    child = subprocess.Popen(command)
    for s in (signal.SIGTERM, signal.SIGINT):  # a pod's deletion, scancel: the trainer saves
        signal.signal(s, lambda signum, frame: child.send_signal(signum))
    return resumable(child.wait(), run_dir, started)


def resumable(code: int, run_dir: str, since: float) -> int:
    """The exit status the targets act on: a signal N as 128 + N, and a 0 after a saved preemption as 42. The
    preemption is read from the attempt's own end record, which process 0 writes before it exits; another host
    that exits first finds none of this attempt's and keeps its 0 (one pod's 42 restarts them all)."""
    code = code if code >= 0 else 128 - code
    return PREEMPTED if code == 0 and attempt_end(run_dir, since) == "preempted" else code


def attempt_end(run_dir: str, since: float) -> str | None:
    """How the run's latest attempt ended ("finished", "preempted", "stopped", "failed": the `how` of the last
    `attempt_end` record in events.jsonl, trainer/telemetry/timeline.py), when that record was written after
    `since`; None when there is none yet or the file cannot be read."""
    try:
        text = _path(f"{run_dir.rstrip('/')}/events.jsonl").read_text()
    except Exception:  # noqa: BLE001 - no record: the exit status stands as it is
        return None
    for line in reversed(text.splitlines()):
        try:
            record = json.loads(line)
        except ValueError:  # a torn last line
            continue
        if record.get("event") == "attempt_end":
            return record.get("how") if record.get("time", 0) >= since else None
    return None


class LogMirror(threading.Thread):
    """Copies a growing local log to `destination` (a gs:// object: objects cannot be appended to, so each copy
    rewrites it whole) every `every` seconds while the command runs, and once more at its end. A VM that is
    lost (preempted, deleted) leaves what was copied last; one created again starts its log from that copy."""

    def __init__(self, log: Path, destination: str, every: float = LOG_EVERY_S):
        super().__init__(daemon=True)
        self.log, self.destination, self.every = log, destination, every
        self.done, self.copied = threading.Event(), -1

    def resume(self) -> None:
        """A host without a local log (a VM created again) continues the bucket's copy rather than replace it."""
        if not self.log.exists():
            try:
                self.log.write_text(_path(self.destination).read_text())
            except Exception:  # noqa: BLE001 - nothing copied yet
                pass

    def run(self) -> None:
        while not self.done.wait(self.every):
            self.copy()

    def finish(self) -> None:
        self.done.set()
        self.join()
        self.copy()

    def copy(self) -> None:
        try:
            size = self.log.stat().st_size
            if size != self.copied:  # unchanged: no upload (GCS allows about one update per second per object)
                _path(self.destination).write_text(self.log.read_text(errors="replace"))
                self.copied = size
        except Exception as e:  # noqa: BLE001 - the training matters more than its log's copy
            print(f"warning: could not copy {self.log} to {self.destination} ({e})", file=sys.stderr, flush=True)


def _path(location: str):
    """etils' path for gs:// (the gcs extra, installed on every host), else a local one."""
    if location.startswith("gs://"):
        from etils import epath

        return epath.Path(location)
    return Path(location)


def state(job: str) -> str:
    pid, status = files(job)
    if status.exists():
        return status.read_text().strip()
    if not pid.exists():
        return "none"
    try:  # the supervisor's command line, not just its pid: after a VM's restart the pid may be another's
        alive = b"tools.pod.host" in Path(f"/proc/{int(pid.read_text())}/cmdline").read_bytes()
    except OSError:
        alive = False
    return "running" if alive else "lost"  # lost: ended unrecorded (the VM restarted, or a kill -9)


def stop(job: str) -> int:
    pid, _ = files(job)
    if pid.exists():
        try:
            os.killpg(int(pid.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.pod.host", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("verb", choices=("start", "run", "state", "stop", "train"))
    p.add_argument("--job", default="")
    p.add_argument("--run_dir", default="")
    p.add_argument("--log_every", type=float, default=LOG_EVERY_S, help="start: seconds between a gs:// console"
                   " log's copies")
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args, command = p.parse_args(argv[:split]), argv[split + 1:]
    if args.verb in ("start", "run", "train") and not (command and args.run_dir):
        p.error(f"{args.verb} needs --run_dir and the command after --")
    if args.verb != "train" and not args.job:
        p.error(f"{args.verb} needs --job")
    if args.verb == "state":
        print(state(args.job))
        return 0
    if args.verb == "stop":
        return stop(args.job)
    if args.verb == "train":
        return train(args.run_dir, command)
    return (start if args.verb == "start" else run)(args.job, args.run_dir, command, args.log_every)


if __name__ == "__main__":
    sys.exit(main())
