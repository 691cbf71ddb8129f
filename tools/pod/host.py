"""The training on a TPU VM, detached from the ssh session that starts it (the tpu-vm target).

    python -m tools.pod.host start --job NAME --run_dir DIR -- .venv/bin/python train.py ...   # returns at once
    python -m tools.pod.host state --job NAME    # running, the exit status, lost (ended unrecorded), or none
    python -m tools.pod.host stop --job NAME     # kills what is left of it (before a restart on these hosts)

`start` leaves the command to a supervisor in its own session (setsid) that ignores SIGHUP (nohup): a dropped ssh
connection, the launcher's or a laptop's, no longer ends the training, and `gcloud ... ssh --worker=all` returns on
every host at once (its batches of --batch-size hosts no longer wait on each other's training). The supervisor
records its pid and, when the command ends, its exit status in ~/gpt2-nnx-job/ (what `state` reads for the
launcher's keep-alive), and keeps the command's output in the run directory: <run_dir>/logs/console.<host>.log as it
is written, or for a gs:// run directory ~/gpt2-nnx-job/NAME.log, copied there when the command ends. Standard
library only (plus etils for that copy): `state` runs once per poll.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

JOBS = "gpt2-nnx-job"  # in the host's home: each job's pid, exit status and (gs:// run directories) log


def files(job: str) -> tuple[Path, Path]:
    """The job's pid file and exit-status file."""
    d = Path.home() / JOBS
    return d / f"{job}.pid", d / f"{job}.exit"


def console_log(job: str, run_dir: str) -> Path:
    """Where the command's output goes while it runs."""
    if run_dir.startswith("gs://"):
        return Path.home() / JOBS / f"{job}.log"
    return Path(run_dir) / "logs" / f"console.{host_name()}.log"


def host_name() -> str:
    return os.environ.get("HOSTNAME") or socket.gethostname()  # HOSTNAME: exported where several share a kernel


def start(job: str, run_dir: str, command: list[str]) -> int:
    pid, status = files(job)
    pid.parent.mkdir(parents=True, exist_ok=True)
    status.unlink(missing_ok=True)
    supervisor = subprocess.Popen([sys.executable, "-m", "tools.pod.host", "run", "--job", job, "--run_dir", run_dir,
                                   "--", *command], start_new_session=True, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pid.write_text(str(supervisor.pid))  # its session's id: `stop` ends the whole group
    print(f"started {job} (pid {supervisor.pid}); its output: {console_log(job, run_dir)}", flush=True)
    return 0


def run(job: str, run_dir: str, command: list[str]) -> int:
    """The supervisor: runs the command to its end, then records its exit status (128 + N for signal N)."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup
    log = console_log(job, run_dir)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    for s in (signal.SIGTERM, signal.SIGINT):  # a VM's shutdown or a maintenance event: the trainer saves
        signal.signal(s, lambda signum, frame: child.send_signal(signum))
    code = child.wait()
    code = code if code >= 0 else 128 - code
    if run_dir.startswith("gs://"):
        copy_log(log, f"{run_dir.rstrip('/')}/logs/console.{host_name()}.log")
    _, status = files(job)
    status.with_suffix(".tmp").write_text(f"{code}\n")
    status.with_suffix(".tmp").replace(status)  # whole or absent: `state` never reads half a number
    return code


def copy_log(log: Path, destination: str) -> None:
    try:
        from etils import epath

        epath.Path(destination).write_text(log.read_text())
    except Exception as e:  # noqa: BLE001 - the exit status matters more than the copy
        print(f"warning: could not copy {log} to {destination} ({e})", file=sys.stderr)


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
    p.add_argument("verb", choices=("start", "run", "state", "stop"))
    p.add_argument("--job", required=True)
    p.add_argument("--run_dir", default="")
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args, command = p.parse_args(argv[:split]), argv[split + 1:]
    if args.verb in ("start", "run") and not (command and args.run_dir):
        p.error(f"{args.verb} needs --run_dir and the command after --")
    if args.verb == "state":
        print(state(args.job))
        return 0
    if args.verb == "stop":
        return stop(args.job)
    return (start if args.verb == "start" else run)(args.job, args.run_dir, command)


if __name__ == "__main__":
    sys.exit(main())
