"""A run's optimizer: the update rule (a registered `OptimizerConfig`: adamw, muon), its learning-rate schedule (a
registered `ScheduleConfig`: cosine, wsd) and the spike guard around both (`GuardConfig`), built into one optax
transformation that also reports what each step did.

Every module of this package is imported here, so a new optimizer or schedule is one file that registers itself
(docs/extending.md); configs/base.py composes these sections into the training config.
"""

from __future__ import annotations

import importlib
import pkgutil

import optax

from optim.base import Optimizer, OptimizerConfig, applied_updates
from optim.schedules import ScheduleConfig
from optim.spike_guard import GuardConfig, guard_notes, spike_guard, step_report

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def build(optimizer: OptimizerConfig, schedule: ScheduleConfig, guard: GuardConfig, total_steps: int,
          width_mult: float | None = None) -> Optimizer:
    """`unguarded` inside the spike guard (always in the chain, so the state has one structure whether it is on or
    off). Each step reports every group's learning rate, read at the optimizer's own count of applied updates (a
    skipped step does not move the schedule), and the guard's skipped / streak."""
    tx = spike_guard(guard, unguarded(optimizer, schedule, total_steps, width_mult))
    rates = group_rates(optimizer, schedule, total_steps)

    def report(before, after) -> dict:
        applied = applied_updates(before.inner)
        return {**{group: rate(applied) for group, rate in rates.items()}, **step_report(before, after)}

    return Optimizer(tx, report, lambda record: guard_notes(guard, record))


def unguarded(optimizer: OptimizerConfig, schedule: ScheduleConfig, total_steps: int,
              width_mult: float | None = None) -> optax.GradientTransformation:
    """Global-norm clipping, then the optimizer's update rule with its rates on `schedule`. `width_mult`: μP's m
    (None: the standard parametrization)."""
    clip = optax.clip_by_global_norm(optimizer.grad_clip) if optimizer.grad_clip > 0 else optax.identity()
    return optax.chain(clip, optimizer.update_rule(group_rates(optimizer, schedule, total_steps), width_mult))


def group_rates(optimizer: OptimizerConfig, schedule: ScheduleConfig, total_steps: int) -> dict[str, optax.Schedule]:
    """Each group's learning rate over the run: its peak on the schedule. What the update applies and what the step
    reports are both these."""
    return {group: schedule.rate(peak, total_steps) for group, peak in optimizer.peak_rates().items()}


__all__ = ["GuardConfig", "Optimizer", "OptimizerConfig", "ScheduleConfig", "build", "unguarded"]
