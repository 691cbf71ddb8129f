"""Preemption: SIGTERM (a TPU VM's maintenance event, a scheduler's eviction) or Ctrl-C becomes "save a
checkpoint at the end of the current call and exit 0", agreed on by every process of the job."""

from __future__ import annotations

import os
import signal

import jax
from jax.experimental import multihost_utils


class Preemption:
    """Turns SIGTERM / SIGINT into "save a checkpoint at the end of a call and exit 0".

    One process: a signal handler sets a flag. Several: JAX's preemption sync point (the coordination service
    sees SIGTERM through its own handler, agrees with every process on a call by which all of them stop, and
    `reached_preemption_sync_point` says when that call is reached; Orbax's `reached_preemption` uses the same).
    SIGINT (Ctrl-C) is turned into a SIGTERM to this process so that it takes the same path; a second
    Ctrl-C stops at once (KeyboardInterrupt), for a run that hangs.
    """

    def __init__(self):
        self.signal_name = None
        self.multiprocess = jax.process_count() > 1
        self.interrupted = False

    def __enter__(self):
        signals = (signal.SIGINT,) if self.multiprocess else (signal.SIGTERM, signal.SIGINT)
        self._previous = {s: signal.signal(s, self._handle) for s in signals}
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.interrupted:  # a second Ctrl-C: stop now (a run that hangs)
            raise KeyboardInterrupt
        self.interrupted = signum == signal.SIGINT
        if self.multiprocess:
            os.kill(os.getpid(), signal.SIGTERM)  # JAX's handler: the stop is agreed with the other processes
        else:
            self.signal_name = signal.Signals(signum).name

    def requested(self, call: int) -> bool:
        """Whether to stop after call number `call` (1, 2, ... in this start; every process asks at every call)."""
        if self.multiprocess:
            if multihost_utils.reached_preemption_sync_point(call):
                self.signal_name = "SIGTERM"
        return self.signal_name is not None
