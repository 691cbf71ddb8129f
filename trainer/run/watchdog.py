"""The stall watchdog: a run whose train calls stop finishing ends, with every thread's stack on file.

Errors and dead processes already end the job (trainer/processes.py). A process that is alive but stuck — a
storage read that never returns, a host frozen by the kernel, a collective waiting on such a peer — raises
nothing, and the others would wait for the coordination service's heartbeat (100 s) or forever. The loop beats
the watchdog whenever a train call (or an evaluation, a checkpoint, a rollback) finishes; when no beat comes for
the stall timeout, a daemon thread writes all threads' Python stacks (faulthandler) to
`<run_dir>/logs/stacks.<process>.txt`, prints one line, tells the other processes (each writes its own stacks
and ends) and leaves through os._exit: the main thread is stuck, and an orderly exit would wait on it or on a
collective. Nothing saved is touched; a save in flight stays a temporary directory that the next start removes.

A stuck thread that holds the GIL (a memmap read from a dead disk does) keeps the watchdog thread from running:
then faulthandler's own C timer, which the watchdog thread keeps re-arming BACKSTOP_S past the deadline, writes
the stacks and exits (status 1) instead.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import jax

from trainer.processes import end_process, set_ending_note

COMPILING = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
             "/jax/core/compile/backend_compile_duration")  # JAX's monitoring events: a compilation's stages
STALL = "stalled"  # a stall's reason starts with it: a peer that ends for it writes its own stacks too
FACTOR = 20  # the automatic timeout: this many median call times (a call's time varies by a few x at most) ...
WINDOW = 101  # ... over the latest calls (bounded: a long run's memory stays flat)
BACKSTOP_S = 10.0  # faulthandler's timer fires this long after the deadline the watchdog thread missed
NOTIFY_S = 5.0  # the most the ending waits for the other processes to hear of it (a frozen coordinator never answers)


def stall_timeout(call_seconds, floor: float, factor: float = FACTOR) -> float:
    """The automatic stall timeout: max(floor, factor × the median call time)."""
    return max(floor, factor * statistics.median(call_seconds)) if call_seconds else floor


class Watchdog:
    """Ends the process (and so the job) when `beat` has not been called for the stall timeout: `timeout`
    seconds, or (None) `stall_timeout` of the call times beaten so far with `floor`; 0: never.

    Armed by the first beat (after the first call: its compilation is not a stall; later ones restart the
    clock); a context manager that disarms it on exit. `end(reason)` ends the process (a test may record the
    reason instead).
    """

    def __init__(self, stacks: Path, *, timeout: float | None, floor: float, process: int = 0,
                 processes: int = 1, end: Callable[[str], None] = lambda reason: end_process(reason, NOTIFY_S)):
        self.path, self.fixed, self.floor, self.end = Path(stacks), timeout, floor, end
        self.where = f" on process {process}" if processes > 1 else ""
        self.times: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.last: float | None = None  # time.monotonic() of the latest beat; None: not armed yet
        self.held = 0  # paused() depth
        self.armed, self.file = False, None
        self.wake, self.ending = threading.Event(), threading.Lock()
        self.thread = threading.Thread(target=self._watch, name="stall-watchdog", daemon=True)

    @property
    def enabled(self) -> bool:
        return self.fixed != 0

    def timeout(self) -> float:
        return self.fixed if self.fixed is not None else stall_timeout(self.times, self.floor)

    def beat(self, call_seconds: float | None = None) -> None:
        """Progress: a train call finished (its time, for the automatic timeout) or other work did (None)."""
        if call_seconds is not None:
            self.times.append(call_seconds)
        self.last = time.monotonic()
        if self.enabled and not self.armed and not self.wake.is_set():
            self.armed, self.file = True, self._open()
            set_ending_note(self.note)
            jax.monitoring.register_event_duration_secs_listener(self._compiled)
            self.thread.start()

    def _compiled(self, event: str, duration: float, **kwargs) -> None:
        """A compilation (the pre-save probe's, the first evaluation's, Orbax's at the first save) is progress,
        not a stall: the clock restarts at the end of each of its stages (trace, lowering, XLA)."""
        if event in COMPILING:
            self.last = time.monotonic()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Work of no bounded length (lm-eval tasks) is not a stall; the clock restarts after it."""
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1
            self.beat()

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, *exc) -> None:
        self.wake.set()  # stops the thread at its next look
        if self.armed:
            jax.monitoring.unregister_event_duration_listener(self._compiled)
            set_ending_note(None)
            self.thread.join(timeout=1)
            faulthandler.cancel_dump_traceback_later()  # after the thread's last re-arming
        if self.file is not None:
            self.file.close()
            with contextlib.suppress(OSError):
                if self.path.stat().st_size == 0:  # no stall: no file
                    self.path.unlink()

    def _watch(self) -> None:
        while not self.wake.is_set():
            timeout = self.timeout()
            left = self.last + timeout - time.monotonic()
            if self.held:
                faulthandler.cancel_dump_traceback_later()
                left = timeout
            elif left <= 0:
                return self._stalled(time.monotonic() - self.last, timeout)
            else:
                faulthandler.dump_traceback_later(left + BACKSTOP_S, exit=True, file=self.file)
            self.wake.wait(left)

    def _stalled(self, stalled: float, timeout: float) -> None:
        if not self.ending.acquire(blocking=False):
            return  # another process's stall is ending this one (note)
        faulthandler.cancel_dump_traceback_later()
        how = "" if self.fixed is not None else ", automatic"
        reason = (f"{STALL}: no train call finished{self.where} for {stalled:.0f} s"
                  f" (--distributed.stall_timeout_seconds: {timeout:g} s{how}); every thread's stack is in {self.path}")
        self._write_stacks(reason)
        self.end(reason)

    def note(self, reason: str) -> str:
        """What this process adds when another process's failure ends it: for a stall, its own stacks."""
        if not reason.startswith(STALL):
            return ""
        if not self.ending.acquire(blocking=False):
            threading.Event().wait()  # this process's own stall is ending it
        self._write_stacks(f"ended by another process: {reason}")
        return f"; its threads' stacks are in {self.path}"

    def _open(self):
        """The stacks file, opened now: faulthandler's timer needs it open before anything is stuck. Appended
        to: a restart must not erase the stacks of the stall before it."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return open(self.path, "a")
        except OSError:  # an unwritable run directory: the run says so itself; the stacks go elsewhere
            self.path = Path(tempfile.gettempdir()) / f"gpt2-nnx-{os.getpid()}-{self.path.name}"
            return open(self.path, "a")

    def _write_stacks(self, header: str) -> None:
        self.file.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {header}\n")
        self.file.flush()
        faulthandler.dump_traceback(self.file, all_threads=True)
        self.file.flush()
