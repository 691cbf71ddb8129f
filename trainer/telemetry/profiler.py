"""A `jax.profiler` trace of chosen steps of a run, for TensorBoard's profile plugin / XProf or Perfetto."""

from __future__ import annotations

import jax

from configs.base import LogConfig
from trainer.processes import is_process_0, say
from trainer.telemetry.timeline import Timeline


class Profile:
    """A trace of the calls covering steps [log.profile_start, + log.profile_steps), written to
    <run_dir>/profile by process 0."""

    def __init__(self, log: LogConfig, directory, timeline: Timeline):
        self.start, self.end = log.profile_start, (log.profile_start or 0) + log.profile_steps
        self.directory, self.timeline = directory, timeline  # starting and writing a trace is not training
        self.active = log.profile_start is not None and is_process_0()
        self.tracing = False

    def __enter__(self):
        return self

    def before_call(self, step: int, n: int) -> None:
        if self.active and not self.tracing and step < self.end and step + n >= self.start:
            with self.timeline.measure("profile"):
                jax.profiler.start_trace(str(self.directory))
            self.tracing = True

    def after_call(self, step: int) -> None:
        if self.tracing and step >= self.end - 1:
            self.__exit__()
            say(f"profile of steps {self.start}-{step}: {self.directory} (tensorboard --logdir {self.directory})")

    def __exit__(self, *exc):
        if self.tracing:
            with self.timeline.measure("profile"):
                jax.profiler.stop_trace()
            self.tracing, self.active = False, False
