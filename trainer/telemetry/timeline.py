"""The timeline of an attempt: process 0 appends one record per event to `<run_dir>/events.jsonl`, which nothing
truncates — an attempt's start (the process's own start time) and end (finished, preempted, stopped, failed; a
start without an end was a crash), each interval of work (start-up, distributed init, restore, data wait,
evaluation, checkpoint saves as Orbax measures their blocking part, sampling, rollback, finishing), each train
call with its step range and its time on the critical path, and each compilation from JAX's own monitoring events
(with whether the persistent cache answered it). trainer/telemetry/goodput.py replays them into the report.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import jax

from trainer.processes import is_process_0
from trainer.storage.files import storage_errors

EVENTS = "events.jsonl"

# the badput categories, in the order the report lists them
INTERVALS = ("startup", "distributed_init", "restore", "data", "eval", "checkpoint", "sample", "rollback", "profile",
             "finish")


def process_start_time() -> float:
    """When this process started (Unix time, to the kernel's 10 ms tick): the attempt's wall time includes
    Python's and JAX's imports. (psutil's create_time adds a boot time rounded to whole seconds: a restarted
    attempt could seem to start before the killed one's last record.)"""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime: clock ticks since boot
        return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux
        return _IMPORTED


_IMPORTED = time.time()


class Timeline:
    """Process 0's record of one attempt (a no-op elsewhere). Records are kept in memory until `commit` (once the
    run has restored and written its config: a start refused for bad input leaves the run directory as it
    was), then appended to events.jsonl as they happen."""

    def __init__(self, run_dir=None, attempt: int = 1, flush_every: float = 30.0):
        self.run_dir, self.attempt, self.flush_every = run_dir, attempt, flush_every  # run_dir None: record nothing
        self.log = None  # events.jsonl's AppendLog, from `commit` on
        self.loaded: tuple[list[dict], bool] | None = None  # events.jsonl as read at the start, until `commit`
        self.pending: list[str] = []
        self.started = process_start_time()
        self._compiling = float("inf")  # the start of the compilation under way (its tracing)
        self._last_span_end = float("-inf")
        self._compiles: dict | None = None  # compilations in a row, recorded as one (see _compiled)
        self._cache_hit: dict[int, bool] = {}  # by thread: the compiling-ahead thread's hits are its own
        self.mark = self.started  # where the latest record ends: what happens after it is not yet accounted for
        # JAX's compile events come from the thread compiling ahead as well (trainer/program/ahead.py)
        self._lock = threading.RLock()

    def record(self, event: str, **fields) -> None:
        if self.run_dir is None:
            return
        with self._lock:
            self._flush_compiles()  # the compilations before this record, as one
            if not fields.get("background"):  # the main thread's own accounting goes on from its own records
                self.mark = max(self.mark, fields.get("end", fields.get("time", self.mark)))
            self.pending.append(json.dumps({"event": event, "attempt": self.attempt, **fields}) + "\n")
            if self.log is not None:
                self._write()

    def commit(self) -> None:
        """From now on records go to events.jsonl (the ones kept so far first)."""
        if self.run_dir is not None and self.log is None:
            self.log = self.run_dir.open_events(self.flush_every, loaded=self.loaded)
            self.loaded = None
            self._write()

    def _write(self) -> None:
        with storage_errors("write", self.log.path):
            for line in self.pending:
                self.log.write(line)
            self.pending.clear()
            self.log.flush()

    def begin(self, **fields) -> None:
        self.record("attempt_start", time=self.started, host=socket.gethostname(), pid=os.getpid(), **fields)

    def end(self, how: str) -> None:
        try:
            self.record("attempt_end", time=time.time(), how=how)
        finally:  # the file is closed even when the disk is full (the record then fails, said elsewhere)
            log, self.run_dir, self.log = self.log, None, None
            if log is not None:
                with storage_errors("write", log.path):
                    log.close()

    def interval(self, kind: str, start: float, end: float | None = None, **fields) -> None:
        self.record("interval", kind=kind, start=start, end=time.time() if end is None else end, **fields)

    def measure(self, kind: str, **fields) -> "_Measured":
        return _Measured(self, kind, fields)

    def since_mark(self, kind: str, **fields) -> None:
        """Records everything since the latest record as `kind` (the caller knows nothing else happened)."""
        self.interval(kind, self.mark, **fields)

    def train_call(self, first_step: int, steps: int, start: float, skipped: int = 0,
                   excluded: tuple[float, float] | None = None) -> float:
        """A train call's time, from `start` to now less the `excluded` span (recorded as something else);
        returns now. (`seconds` is for a reader of the file: the report carves compilations out of the span.)"""
        end = time.time()
        fields = {"excluded": list(excluded)} if excluded else {}
        seconds = end - start - (excluded[1] - excluded[0] if excluded else 0.0)
        self.record("train_call", first=first_step, steps=steps, seconds=seconds, skipped=skipped, start=start,
                    end=end, **fields)
        return end

    def restored(self, step: int) -> None:
        self.record("restored", step=step, time=time.time())

    def rolled_back(self, step: int) -> None:
        self.record("rolled_back", step=step, time=time.time())

    # JAX's monitoring events (registered once per process; see `listen_to_jax`)

    def on_jax_event(self, event: str, **kwargs) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self._cache_hit[threading.get_ident()] = True

    def on_jax_span(self, event: str, start: float, end: float, **kwargs) -> None:
        """One record per compiled program, from its tracing's start to its backend compile's end (a trace
        that no compile follows, e.g. jax.eval_shape's, stays in the interval it happened in)."""
        stage = _COMPILE_STAGES.get(event)
        if stage is None:
            return
        if threading.current_thread() is not threading.main_thread():  # compiling ahead (trainer/program/ahead.py)
            if stage == "backend":  # one record per program, apart: the main thread worked meanwhile, and its
                # waits for these compiles are recorded as compile time where they happen
                hit = self._cache_hit.pop(threading.get_ident(), False)
                fun = str(kwargs.get("fun_name", ""))
                self.record("interval", kind="compile", start=start, end=end, background=True, programs={fun: 1},
                            cache_hits={fun: 1} if hit else {})
            return
        with self._lock:
            if start > self._last_span_end + 0.5:  # not the next stage of the same compilation
                self._compiling = start
            self._compiling, self._last_span_end = min(start, self._compiling), end
            if stage == "backend":
                self._compiled(self._compiling, end, str(kwargs.get("fun_name", "")))
                self._compiling = float("inf")
                self._cache_hit.pop(threading.get_ident(), None)

    def _compiled(self, start: float, end: float, fun: str) -> None:
        """Adds a compilation to the record being gathered: compilations in a row (a checkpoint save compiles
        dozens of tiny slicing programs) make one record, with how many of each program and cache hits."""
        if self._compiles is not None and start - self._compiles["end"] > 0.5:
            self._flush_compiles()
        if self._compiles is None:
            self._compiles = {"start": start, "end": end, "programs": {}, "cache_hits": {}}
        group = self._compiles
        group["end"] = end
        group["programs"][fun] = group["programs"].get(fun, 0) + 1
        if self._cache_hit.get(threading.get_ident()):
            group["cache_hits"][fun] = group["cache_hits"].get(fun, 0) + 1


    def _flush_compiles(self) -> None:
        if self._compiles is not None:
            compiles, self._compiles = self._compiles, None
            self.record("interval", kind="compile", **compiles)


def open_timeline(run_dir, entered: float, joined: float, flush_every: float = 30.0) -> Timeline:
    """This attempt's timeline: on process 0 for the run's events.jsonl (numbered after the attempts already
    there), with the start-up before `entered` (imports) and the distributed init until `joined`;
    elsewhere a timeline that records nothing."""
    if not is_process_0():
        return Timeline()
    loaded = run_dir.load_events(say_torn=False)  # read once: commit's open_events repairs a torn line, says so
    timeline = Timeline(run_dir, attempt=1 + sum(r.get("event") == "attempt_start" for r in loaded[0]),
                        flush_every=flush_every)
    timeline.loaded = loaded
    timeline.begin()
    timeline.interval("startup", timeline.started, entered)
    timeline.interval("distributed_init", entered, joined)
    listen_to_jax(timeline)
    return timeline


class _Measured:
    def __init__(self, timeline: Timeline, kind: str, fields: dict):
        self.timeline, self.kind, self.fields = timeline, kind, fields

    def __enter__(self):
        self.start = time.time()
        return self

    def __exit__(self, *exc):
        self.timeline.interval(self.kind, self.start, **self.fields)


_COMPILE_STAGES = {"/jax/core/compile/jaxpr_trace_duration": "trace",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
                   "/jax/core/compile/backend_compile_duration": "backend"}
_current: list[Timeline] = []  # the timeline JAX's events go to (listeners cannot be removed: registered once)


def listen_to_jax(timeline: Timeline) -> None:
    """Sends JAX's compile events to `timeline` from now on."""
    if not _current:
        jax.monitoring.register_event_listener(lambda event, **kw: _current[-1].on_jax_event(event, **kw))
        jax.monitoring.register_event_time_span_listener(
            lambda event, start, end, **kw: _current[-1].on_jax_span(event, start, end, **kw))
        _current.append(timeline)
    _current[-1] = timeline


class OrbaxSaveTimes:
    """An Orbax logger: records each save's blocking time from Orbax's own statistics
    (`checkpoint_manager_blocking_duration_secs`) on the timeline."""

    def __init__(self, timeline: Timeline):
        self.timeline = timeline

    def log_entry(self, entry, *args, **kwargs) -> None:
        if isinstance(entry, dict) and entry.get("event_type") == "save":
            start = entry.get("checkpoint_manager_blocking_start_time")
            seconds = entry.get("checkpoint_manager_blocking_duration_secs")
            if start is not None and seconds is not None:
                self.timeline.interval("checkpoint", start, start + seconds, step=entry.get("step"))
