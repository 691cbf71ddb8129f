"""Learning-rate schedules: the shape of every optimizer group's rate over the run, from its peak. A schedule is
one registered class (docs/extending.md): its fields, and `rate(peak, total_steps)`.

A resumed run may not change its schedule (trainer/run/resume.py compares `curve`, the whole resolved config),
unless train.reschedule says so.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

import optax

from fields import Choice, Field


@dataclasses.dataclass(frozen=True)
class ScheduleConfig(Choice, section="schedule"):
    """The learning rate over the run (--schedule.name): each optimizer group's peak rate × this shape."""

    warmup_steps: Annotated[int, Field("linear warmup from 0, in steps", ge=0)] = 100

    def rate(self, peak: float, total_steps: int) -> optax.Schedule:
        """The rate at each applied update (the optimizer's own count: a skipped step does not move it)."""
        raise NotImplementedError

    def curve(self, total_steps: int) -> dict:
        """Everything that fixes the rate at every step of a run of `total_steps`: what a resume compares."""
        return {**dataclasses.asdict(self), "total_steps": total_steps}

    def extension_hint(self, step: int) -> str:
        """How to continue a run that finished at `step` on this same schedule, as flags."""
        return "--train.steps=MORE --train.reschedule=True (the schedule then stretches to the new length)"


@dataclasses.dataclass(frozen=True)
class CosineSchedule(ScheduleConfig, choice="cosine"):
    """Linear warmup, then a cosine from the peak down to a floor (nanoGPT's, Chinchilla's)."""

    decay_steps: Annotated[int | None, Field("end of the cosine (default: train.steps)", ge=1)] = None
    min_lr_ratio: Annotated[float, Field(
        "the cosine floor as a fraction of the peak (Chinchilla / nanoGPT use 0.1)", ge=0, le=1)] = 0.1

    def rate(self, peak: float, total_steps: int) -> optax.Schedule:
        decay_steps = max(self.decay_steps or total_steps, self.warmup_steps + 1)
        return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=peak, warmup_steps=self.warmup_steps,
                                                  decay_steps=decay_steps, end_value=peak * self.min_lr_ratio)

    def curve(self, total_steps: int) -> dict:
        return {**dataclasses.asdict(self), "decay_steps": self.decay_steps or total_steps}  # train.steps: unset

    def extension_hint(self, step: int) -> str:
        if self.decay_steps:
            return "--train.steps=MORE"
        return (f"--train.steps=MORE --schedule.decay_steps={step} (the learning rate stays at its final value;"
                " --train.reschedule=True instead for a new cosine)")


@dataclasses.dataclass(frozen=True)
class WSDSchedule(ScheduleConfig, choice="wsd"):
    """Warmup, stable, decay: the peak held until the last `decay_fraction` of the run, then a linear decay to the
    floor (Hu et al. 2024, MiniCPM; Hägele et al. 2024 match a cosine's loss with a 20 % cooldown). A run may be
    extended from a checkpoint of its stable phase without changing what came before."""

    decay_fraction: Annotated[float, Field("the final share of the run spent decaying", gt=0, le=1)] = 0.2
    min_lr_ratio: Annotated[float, Field("the rate after the decay, as a fraction of the peak", ge=0, le=1)] = 0.0

    def rate(self, peak: float, total_steps: int) -> optax.Schedule:
        decay = max(1, round(total_steps * self.decay_fraction))
        stable = max(0, total_steps - decay - self.warmup_steps)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, peak, self.warmup_steps), optax.constant_schedule(peak),
             optax.linear_schedule(peak, peak * self.min_lr_ratio, decay)],
            boundaries=[self.warmup_steps, self.warmup_steps + stable])
