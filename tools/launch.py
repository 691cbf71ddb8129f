"""Run a JAX program as several processes on this machine, the way a pod runs one per host.

    python -m tools.launch --num_processes 2 --devices_per_process 4 -- python train.py --train.steps=20

Each process gets `devices_per_process` fake CPU devices, CPU collectives (gloo) and the JAX_COORDINATOR_ADDRESS /
JAX_NUM_PROCESSES / JAX_PROCESS_ID variables that `train.py` and `eval.py` read. Output lines are prefixed with
the process index. When one process fails, the others are stopped after `--grace` seconds, and the launcher
exits with the first failure's status — a debugging session never hangs on a dead peer.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(command: list[str], num_processes: int, devices_per_process: int, *, port: int | None = None,
           grace: float = 30.0, env: dict | None = None) -> int:
    port = port or free_port()
    procs = []
    for pid in range(num_processes):
        child_env = {
            **os.environ, **(env or {}),
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": _xla_flags(devices_per_process),
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_NUM_PROCESSES": str(num_processes),
            "JAX_PROCESS_ID": str(pid),
        }
        p = subprocess.Popen(command, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=_relay, args=(p, pid), daemon=True).start()
        procs.append(p)
    forward = lambda signum, frame: [p.send_signal(signum) for p in procs if p.poll() is None]  # noqa: E731
    for s in (signal.SIGTERM, signal.SIGINT):  # preemption reaches every "host"
        signal.signal(s, forward)
    return _wait(procs, grace)


def _xla_flags(devices: int) -> str:
    """The caller's own XLA flags (a dump directory, say) with this launcher's device count in place of theirs."""
    count = "--xla_force_host_platform_device_count"
    own = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(count)]
    return " ".join([*own, f"{count}={devices}"])


def _relay(p: subprocess.Popen, pid: int) -> None:
    for line in p.stdout:
        sys.stdout.write(f"[p{pid}] {line}")
        sys.stdout.flush()


def _wait(procs: list[subprocess.Popen], grace: float) -> int:
    failed_at, status = None, 0
    while any(p.poll() is None for p in procs):
        codes = [p.poll() for p in procs]
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()
            status = next(c for c in codes if c not in (None, 0))
            print(f"[launch] a process exited with status {status}; stopping the others in {grace:.0f}s",
                  file=sys.stderr)
        if failed_at is not None and time.monotonic() - failed_at > grace:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.2)
    codes = [p.returncode for p in procs]
    return status or next((c for c in codes if c != 0), 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_processes", type=int, default=2)
    parser.add_argument("--devices_per_process", type=int, default=4)
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    parser.add_argument("--grace", type=float, default=30.0, help="seconds before stopping peers of a failure")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command each process runs")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    return launch(command, args.num_processes, args.devices_per_process, port=args.port, grace=args.grace)


if __name__ == "__main__":
    sys.exit(main())
