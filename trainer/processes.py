"""The job's processes: joining a multi-process job, and every act that needs all of them to agree.

A pod runs one program per host. Whatever one process decides alone (it could not take the run directory, a
checkpoint does not restore on it) must become the job's decision, or the others wait forever in their next
collective. Every such agreement goes through here; with one process each is a no-op. An error that one process
meets alone, at any point after the job has formed, ends every process within seconds (`failing_together`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from typing import Callable, Iterator, TypeVar

import jax
import numpy as np
from jax._src import distributed  # the coordination service's client: JAX exposes no public handle to it
from jax.experimental import multihost_utils

from configs.base import DistributedConfig
from errors import RUN_LOG, ConfigError, UserError, first_line
from trainer.rollcall import roll_call

T = TypeVar("T")
# A TPU VM's metadata server, which JAX's cluster detection asks, can be unreachable for moments (a VM just up, a
# maintenance event): JAX retries a refused answer, not a refused connection, so a failed connection is retried
# for this long (its other errors, e.g. the coordinator's name not resolving after initialization_timeout, are not).
DETECTION_RETRY_S = 60.0


def initialize_distributed(d: DistributedConfig) -> None:
    """Joins the multi-process job when there is one: explicit settings (flags, then JAX_* variables, as the
    local launcher tools/launch.py gives them), else JAX's own cluster detection (Cloud TPU VMs and GKE, Slurm,
    Open MPI, Kubernetes); none of them: one process. Every process checks in with process 0 first
    (trainer/rollcall.py): one that never starts is named in one line on the others, `initialization_timeout`
    after process 0's start, instead of JAX's abort."""
    address, num, pid = job_settings(d)
    if address is None:
        return
    if os.environ.get("JAX_PLATFORMS", "") == "cpu" or jax.config.jax_platforms == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    roll_call(address, num, pid, d.initialization_timeout)
    jax.distributed.initialize(coordinator_address=address, num_processes=num, process_id=pid,
                               heartbeat_timeout_seconds=d.heartbeat_timeout_seconds,
                               initialization_timeout=d.initialization_timeout)


def job_settings(d: DistributedConfig) -> tuple[str | None, int | None, int | None]:
    """(coordinator address, process count, this process's id); (None, ...) where there is no job to join. The
    detection is the one jax.distributed.initialize() runs (JAX keeps it private); its choice of local devices
    is left to it (JAX_LOCAL_DEVICE_IDS, else its default, e.g. one GPU per Slurm task)."""
    address = d.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if address is not None:
        return (address, _setting("distributed.num_processes", d.num_processes, "JAX_NUM_PROCESSES"),
                _setting("distributed.process_id", d.process_id, "JAX_PROCESS_ID"))
    from jax._src.clusters import ClusterEnv

    started, pause = time.monotonic(), 1.0
    while True:
        try:
            address, num, pid, _ = ClusterEnv.auto_detect_unset_distributed_params(
                None, d.num_processes, d.process_id, None, None, d.initialization_timeout)
            return address, num, pid
        except OSError as e:  # a refused or reset connection (requests' errors are OSErrors)
            waited = time.monotonic() - started
            if waited + pause > DETECTION_RETRY_S:
                raise UserError(f"this host could not tell which job it belongs to: JAX's cluster detection could not"
                                f" connect for {waited:.0f} s ({first_line(e)}; on a Cloud TPU VM: its metadata"
                                " server): run the command again, or set --distributed.coordinator_address,"
                                " num_processes and process_id") from None
            time.sleep(pause)
            pause = min(2 * pause, 8.0)


def _setting(flag: str, value: int | None, variable: str) -> int:
    if value is not None:
        return value
    try:
        return int(os.environ[variable])
    except (KeyError, ValueError):
        raise ConfigError(f"a coordinator address is set, so --{flag} (or {variable}) must be an integer too"
                          ) from None


def is_process_0() -> bool:
    """The process that writes the run's shared files and prints to the console."""
    return jax.process_index() == 0


def say(text: str) -> None:
    """Prints once per job (on process 0)."""
    if is_process_0():
        print(text, flush=True)
    RUN_LOG.info(text)


def barrier(name: str) -> None:
    """Waits for every process."""
    if jax.process_count() > 1:
        start_up_point(f"the barrier {name}")
        multihost_utils.sync_global_devices(name)


def all_agree(ok: bool) -> bool:
    """True only when `ok` is true on every process."""
    if jax.process_count() == 1:
        return ok
    start_up_point("an agreement of all processes")
    return _agree(ok)


def _agree(ok: bool) -> bool:
    return bool(np.all(multihost_utils.process_allgather(np.array(ok))))


def on_process_0(act: Callable[[], T], what: str) -> T | None:
    """Runs `act` on process 0 only; if it raises a UserError, every process raises one (process 0 its own, the
    others one naming `what` process 0 could not do), so no process is left waiting for the others."""
    failure, result = None, None
    if jax.process_count() > 1:
        start_up_point(f"the point where process 0 would {what}")
    if is_process_0():
        try:
            result = act()
        except UserError as e:
            failure = e
    if jax.process_count() > 1 and not _agree(failure is None):
        raise failure or UserError(f"process 0 could not {what}; its error is on its console")
    if failure is not None:
        raise failure
    return result


# ---- the start-up: from the job's forming to its first train call -----------------------------------

_START_UP = "gpt2_nnx/start_up/"  # per start-up point, a key for each process that came to it
BACKSTOP_S = 30  # past the start-up deadline, a process still without a finished train call ends itself


class _StartUp:
    """Bounds the job's start-up: from the moment it formed, every process must finish its first train call
    within `seconds` (--distributed.startup_timeout_seconds, minutes: restoring and compiling on a pod take
    minutes). Every agreement on the way, and the first train call, is a start-up point: each process waits there
    for all the others (the coordination service's barrier), at most until the deadline; the ones that did not
    come are named (each process leaves a key at each point), in one line on every process, instead of the
    others waiting in a collective (on a TPU for ever; CPU collectives give a late peer 30 s, then raise a
    CoordinationServiceError). A process stuck inside a call (compiling, or in a collective that a stuck peer
    never joins) reaches no point: BACKSTOP_S after the deadline it ends itself in one line."""

    def __init__(self, client, me: int, n: int, seconds: float):
        self.client, self.me, self.n, self.seconds = client, me, n, seconds
        self.deadline, self.points = time.monotonic() + seconds, 0
        self.finished = threading.Event()
        threading.Thread(target=self._backstop, name="start-up-backstop", daemon=True).start()

    def reach(self, point: str) -> None:
        key, self.points = f"{_START_UP}{self.points}", self.points + 1  # the same sequence on every process
        self.client.key_value_set(f"{key}/{self.me}", point)
        left_ms = max(1, int((self.deadline - time.monotonic()) * 1000))
        try:
            self.client.wait_at_barrier(key, left_ms)
        except Exception as e:  # noqa: BLE001 - jaxlib's runtime error; only a timeout is ours to word
            if "DEADLINE_EXCEEDED" not in str(e):
                raise
            raise UserError(self._late(key, point)) from None

    def _late(self, key: str, point: str) -> str:
        came = {int(k.rsplit("/", 1)[1]) for k, _ in self.client.key_value_dir_get(f"{key}/")}
        late = sorted(set(range(self.n)) - came)
        who = f"process {late[0]}" if len(late) == 1 else f"processes {', '.join(map(str, late))}"
        return (f"start-up: {who} did not come to {point} within {self.seconds:g} s of the job forming"
                " (--distributed.startup_timeout_seconds); the other processes did")

    def _backstop(self) -> None:
        if not self.finished.wait(max(0.0, self.deadline - time.monotonic()) + BACKSTOP_S):
            end_process(f"start-up: no train call finished on process {self.me} within {self.seconds:g} s (+"
                        f"{BACKSTOP_S} s) of the job forming (--distributed.startup_timeout_seconds): it is stuck in"
                        " its first call (compiling, or in a collective a stuck process never joined)", notify_s=5)


_start_up: _StartUp | None = None  # set from the job's forming until the first train call finished


def start_up_point(point: str) -> None:
    """During the start-up, waits until every process has come to `point` (see _StartUp); else nothing."""
    if _start_up is not None and not _start_up.finished.is_set():
        _start_up.reach(point)


def first_call_finished() -> None:
    """This process's first train call has finished: the start-up is over."""
    if _start_up is not None:
        _start_up.finished.set()


# ---- one failure ends the job --------------------------------------------------------------------

_STOP = "gpt2_nnx/stop/"  # the coordination service's key for each process: "done", or the failure that ends it
_GONE = "gpt2_nnx/gone/"  # set by each process that ends after a failure
_WAIT_FOR_PEERS_S = 10  # how long the first process waits for the others before it exits (it hosts the service)
_POLL_MS = 3_600_000  # a watcher's get: one request per hour when nothing happens


class _Job:
    """The job's failure protocol, through the jax.distributed coordination service's key-value store
    (host-only requests to process 0, never a device collective, so nothing in the train loop waits on it).

    A process whose run fails sets every other process's stop key to its one-line reason. Each process has a
    watcher thread blocked on its own stop key (one long-poll request; the loop itself never asks anything, so
    a train call costs nothing more); the watcher prints "process N failed (reason)" and ends its process at
    once, wherever the main thread is waiting (a device collective that needs the failed process, an Orbax
    barrier, a data read). Calls already dispatched need not be joined: every process leaves. Process 0 hosts
    the coordination service, so it exits last: it waits until every other process has said it is going (or
    _WAIT_FOR_PEERS_S has passed, for a process that is already dead).
    """

    def __init__(self):
        self.client = distributed.global_state.client
        self.me, self.n = jax.process_index(), jax.process_count()
        self.failing = False  # this process is reporting its own failure: its watcher stands aside
        self.watcher = threading.Thread(target=self._watch, name="job-failure-watcher", daemon=True)
        self.watcher.start()

    def _watch(self) -> None:
        while True:
            try:
                value = self.client.blocking_key_value_get(_STOP + str(self.me), _POLL_MS)
                break
            except Exception as e:  # noqa: BLE001 - the client reports a timeout as a generic runtime error
                if "DEADLINE_EXCEEDED" not in str(e):
                    return  # the service is gone (shutdown at exit): nothing left to watch
        if value == "done":
            return
        if self.me == 0:  # an error every process meets at once: process 0 reports its own, which names the cause
            time.sleep(0.5)
        if not self.failing:
            self._end(value)

    def _end(self, value: str) -> None:
        """Ends this process because another one failed (`value` is "N: reason")."""
        who, _, reason = value.partition(": ")
        note = ""
        if _ending_note is not None:
            with contextlib.suppress(Exception):  # the line and the exit matter more than the note
                note = _ending_note(reason)
        self._going()
        print(f"error: process {who} failed ({reason}); process {self.me} stops with it{note}", file=sys.stderr,
              flush=True)
        os._exit(2)

    def _going(self) -> None:
        with contextlib.suppress(Exception):
            self.client.key_value_set(_GONE + str(self.me), "1")
        if self.me == 0:  # the others' requests need the service until they have read their stop key
            self.wait_for_others(_WAIT_FOR_PEERS_S)
            time.sleep(0.2)  # their os._exit after setting the key

    def wait_for_others(self, seconds: float) -> None:
        """Waits (at most `seconds`) until every other process has said it is going."""
        deadline = time.monotonic() + seconds
        for other in range(self.n):
            if other != self.me:
                left_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
                with contextlib.suppress(Exception):
                    self.client.blocking_key_value_get(_GONE + str(other), max(left_ms, 1))

    def fail(self, reason: str, *, own: bool = True) -> None:
        """Reports this process's failure to every other process (the first report stands). An error that is not
        the process's `own` (not a user-facing one: a collective broken by a process that died) gives way to an
        earlier report."""
        earlier = None if own else self._earlier_failure()
        if earlier is not None:
            self._end(earlier)
        self.failing = True
        for other in range(self.n):
            if other != self.me:
                with contextlib.suppress(Exception):  # ALREADY_EXISTS: another process reported first
                    self.client.key_value_set(_STOP + str(other), f"{self.me}: {reason}")
        self._going()

    def _earlier_failure(self) -> str | None:
        with contextlib.suppress(Exception):
            value = self.client.key_value_try_get(_STOP + str(self.me))
            return None if value == "done" else value
        return None

    def done(self) -> None:
        """Stops the watcher (the run ended normally on this process)."""
        with contextlib.suppress(Exception):
            self.client.key_value_set(_STOP + str(self.me), "done")
        self.watcher.join(timeout=5)


_job: _Job | None = None  # set while failing_together is active on a job of several processes
_ending_note: Callable[[str], str] | None = None  # see set_ending_note


def set_ending_note(note: Callable[[str], str] | None) -> None:
    """What this process does first when another process's failure ends it: `note(reason)` may leave a record
    (the stall watchdog writes its threads' stacks) and returns text for the end of its one line."""
    global _ending_note
    _ending_note = note


def end_process(reason: str, notify_s: float) -> None:
    """Ends this process now, from any thread, without waiting on the main thread or a collective: one line,
    the other processes told, exit 2. It waits (at most `notify_s`: a frozen coordinator never answers) until
    the others have ended: while it lives they are still where they were stuck when their notes (stacks) are
    taken, not unwinding from the collective its exit breaks. For a process that can no longer finish its work
    (it is stuck), where end_job's caller still could."""
    print(f"error: {reason}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    if _job is not None:
        job = _job

        def tell() -> None:
            job.fail(reason)
            job.wait_for_others(notify_s)

        telling = threading.Thread(target=tell, name="job-ending", daemon=True)
        telling.start()
        telling.join(notify_s)
    os._exit(2)


def end_job(reason: str) -> None:
    """Ends every process of the job now, from any thread: for a failure that happens where no exception can
    reach the main thread in time (an Orbax writer thread, while the main thread waits in a barrier that the
    failure will never let finish). One process: does nothing (the failure surfaces in the main thread)."""
    if _job is None:
        return
    _job.fail(reason)
    print(f"error: {reason}", file=sys.stderr, flush=True)
    os._exit(2)


@contextlib.contextmanager
def failing_together(startup_timeout: float = 0) -> Iterator[None]:
    """Any error that ends one process ends every process of the job, within seconds: the failing process
    exits with its own one-line error, the others with "process N failed (reason)". Without it the others
    would wait in their next collective until the coordination service's heartbeat timeout (~100 s), then die
    with a traceback. Every process of a failing job leaves through os._exit: an orderly exit would wait at
    jax.distributed's shutdown barrier for processes that are gone. `startup_timeout` > 0: the start-up until
    the first train call (`first_call_finished`) is bounded too (_StartUp)."""
    global _job, _start_up
    if jax.process_count() == 1:
        yield
        return
    job = _job = _Job()
    if startup_timeout > 0:
        _start_up = _StartUp(job.client, job.me, job.n, startup_timeout)
    try:
        yield
        job.done()
    except UserError as e:
        job.fail(first_line(e))
        e.abandon_threads = True  # leave through os._exit (errors.one_line_errors)
        raise
    except BaseException as e:
        job.fail(f"{type(e).__name__}: {first_line(e)}", own=False)
        traceback.print_exc()  # not a user's error: its traceback is the report
        sys.stderr.flush()
        os._exit(1)
    finally:
        if _start_up is not None:
            _start_up.finished.set()
        _job, _start_up = None, None
