"""The roll-call before a multi-process job forms: every process checks in with process 0, or every process that
can ends in one line naming those that did not.

`jax.distributed.initialize` forms the job all at once: each process's connect waits for every other, and when one
never comes, the coordination service's error ends every waiting process through a C++ LOG(FATAL) (SIGABRT, exit
134, a check-failure stack) that names nobody; the client's error callback that could replace it does not take a
Python function in jaxlib 0.10.2 (nanobind cannot pass it the absl::Status: "std::bad_cast"). So before it, each
process checks in with process 0 at the coordinator's own address: process 0 listens there (plain TCP, one line
each way) until every process has checked in, answers "go" and closes the port, which JAX's coordination service
then takes; or, `timeout` seconds after its start, answers the list of those missing. A process that cannot reach
process 0 within `timeout` of its own start says so. Nothing here runs once the job has formed.
"""

from __future__ import annotations

import socket
import time

from errors import UserError

MAGIC = "gpt2-nnx roll-call"
RETRY_S = 1.0  # between a process's attempts to reach process 0 (which may start later than it)
READ_S = 10.0  # for a check-in's one line once connected


class JobDidNotForm(UserError):
    pass


def roll_call(address: str, num_processes: int, process_id: int, timeout: float) -> None:
    """Returns once every process has checked in; raises JobDidNotForm (one line) otherwise."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")  # an IPv6 literal
    if num_processes > 1:
        if process_id == 0:
            _take_the_roll(int(port), num_processes, timeout)
        else:
            _check_in(host, int(port), process_id, num_processes, timeout)


def _take_the_roll(port: int, n: int, timeout: float) -> None:
    """Process 0: accepts check-ins until all n are in or `timeout` has passed, then answers every one."""
    present: dict[int, socket.socket] = {}
    deadline = time.monotonic() + timeout
    with _listen(port) as server:
        server.settimeout(0.2)
        while len(present) < n - 1 and time.monotonic() < deadline:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            pid = _read_check_in(conn, n)
            if pid is None or pid in present:  # not a process of this job, or a second one with its id
                conn.close()
            else:
                present[pid] = conn
    missing = sorted(set(range(1, n)) - set(present))
    for conn in present.values():
        with conn:
            _send(conn, "go" if not missing else "missing " + ",".join(map(str, missing)))
    if missing:
        raise JobDidNotForm(_missing(missing, n, timeout))


def _listen(port: int) -> socket.socket:
    """On every address, as JAX's coordination service will ([::]:port)."""
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", port))


def _read_check_in(conn: socket.socket, n: int) -> int | None:
    conn.settimeout(READ_S)
    try:
        words = conn.makefile("r").readline().split()
    except OSError:
        return None
    ok = len(words) == 4 and " ".join(words[:2]) == MAGIC and words[3] == str(n) and words[2].isdigit()
    return int(words[2]) if ok and 0 < int(words[2]) < n else None


def _send(conn: socket.socket, line: str) -> None:
    try:
        conn.sendall(f"{line}\n".encode())
    except OSError:
        pass  # that process has gone: it learns nothing, the others do


def _check_in(host: str, port: int, pid: int, n: int, timeout: float) -> None:
    """Process `pid`: checks in (retrying until `timeout` while process 0 is not there yet), then waits for
    process 0's answer, which comes at the latest `timeout` after process 0's start."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=READ_S)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise JobDidNotForm(f"the job did not form: process 0 (the coordinator, {host}:{port}) did not"
                                    f" answer process {pid} within {timeout:g} s (--distributed.initialization_timeout)"
                                    ": it did not start, or this host cannot reach it") from None
            time.sleep(RETRY_S)
    with conn:
        conn.sendall(f"{MAGIC} {pid} {n}\n".encode())
        conn.settimeout(timeout + READ_S)
        try:
            answer = conn.makefile("r").readline().split()
        except OSError:
            answer = []
    if answer[:1] == ["go"]:
        return
    if answer[:1] == ["missing"]:
        raise JobDidNotForm(_missing([int(p) for p in answer[1].split(",")], n, timeout))
    raise JobDidNotForm(f"the job did not form: process 0 (the coordinator, {host}:{port}) ended, or refused"
                        f" process {pid} (another process has its id?), before every process had checked in")


def _missing(missing: list[int], n: int, timeout: float) -> str:
    who = f"process {missing[0]}" if len(missing) == 1 else f"processes {', '.join(map(str, missing))}"
    return (f"the job did not form: {who} of {n} did not check in within {timeout:g} s of process 0's start"
            " (--distributed.initialization_timeout): not started, or unable to reach process 0")
