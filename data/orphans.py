"""No loader process outlives its trainer: each Grain worker process ends as soon as the process that started it does,
however that one ended (SIGKILL and the kernel's OOM killer included, which run no handler and no `atexit`).

Grain starts its workers (`mp_prefetch`, multiprocessing's "spawn") and runs `worker_init_fn` in each before it reads
anything; `end_with_parent` is that function. It starts a daemon thread in the worker that waits for the parent to
end and then kills the worker:

- On Linux (5.3 and later) it waits on a pidfd of the parent (`os.pidfd_open`), which the kernel makes readable the
  moment the parent *process* exits: no polling, no delay.
- Elsewhere (macOS) it asks `os.getppid()` twice a second: an orphan is adopted by launchd/init, so its parent's pid
  changes. A worker then outlives its trainer by up to half a second.

Why not `prctl(PR_SET_PDEATHSIG, SIGKILL)`: the kernel sends that signal when the *thread* that forked the worker
ends, not the process. Grain (0.2.18) forks each worker from a prefetch thread
(`ThreadPrefetchDatasetIterator._prefetch_thread`) that it stops and replaces whenever the iterator's state is set
(a resume), keeping the worker: tried, the workers were killed under a live iterator, which then waited forever for
its next batch (tests/unit/test_data.py sets the state of a running one).

multiprocessing's resource tracker, the other child a run with workers has, needs nothing: it exits by itself once
every process holding its pipe has ended — the trainer and the workers — after unlinking the shared memory and
semaphores they left behind.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time

POLL_S = 0.5  # where there is no pidfd: how often a worker asks whether its parent is still there


def end_with_parent(parent: int, worker_index: int = 0, worker_count: int = 1) -> None:
    """Grain's `worker_init_fn` (with the trainer's pid bound): this worker ends when process `parent` does."""
    del worker_index, worker_count  # Grain passes them; every worker does the same
    threading.Thread(target=_wait_then_end, args=(parent,), name="end-with-parent", daemon=True).start()


def _wait_then_end(parent: int) -> None:
    _wait_for_exit(parent)
    os.kill(os.getpid(), signal.SIGKILL)  # as the parent was: no handler, no buffers flushed, nothing left running


def _wait_for_exit(parent: int) -> None:
    if os.getppid() != parent:  # it ended before this worker got here (its pid may even be reused by now)
        return
    try:
        pidfd = os.pidfd_open(parent)
    except (AttributeError, OSError):  # no pidfds (macOS, Linux before 5.3), or the parent just ended
        while os.getppid() == parent:
            time.sleep(POLL_S)
        return
    if os.getppid() == parent:  # still ours once the pidfd is open: it cannot name another process now
        select.select([pidfd], [], [])  # readable once the parent has exited
