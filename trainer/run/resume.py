"""Where a start begins: the newest checkpoint that restores and fits this run, or a fresh (or fine-tune's
imported) state. A resumed run continues exactly: the same parameters, optimizer moments, step, RNG and
data position as if it had never stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses

from configs.base import Config
from trainer.processes import say
from trainer.program.ahead import OVERLAP_COMPILES
from trainer.run import data_position, init_from
from trainer.run.context import RunContext
from trainer.storage.checkpoints import CheckpointMismatch, check_compatible, config_from_meta


@dataclasses.dataclass
class Restored:
    """A restored or fresh state, or a run already finished."""

    step: int
    state: dict | None = None
    meta: dict = dataclasses.field(default_factory=dict)
    finished: bool = False


def restore(run: RunContext) -> Restored:
    """The newest checkpoint that restores (a finished run is not restored at all), or a fresh state."""
    cfg, program = run.cfg, run.program

    def attempt(step: int, saved: dict) -> dict | None:
        with another_run_hint(run):
            check_compatible(saved, cfg, run.ckpt.path(step))
        if step >= cfg.train.steps:
            return None
        with another_run_hint(run):
            data_position.check_same_data(saved, cfg, run.corpus, run.ckpt.path(step))
        check_same_schedule(saved, cfg, run.ckpt.path(step))
        run.train_call  # it fits: the train call compiles while its arrays load
        state = restore_state(run, step, saved)
        data_position.restore(run.ckpt, step, run.train_iter)
        data_position.realign(saved, cfg, run.train_iter, run.ckpt.path(step))
        run.start_loader()
        return state

    found = run.ckpt.restore_latest(attempt)
    if found is None:
        if cfg.init_from:
            say(f"initialized from {cfg.init_from} (Hugging Face weights; fresh optimizer)")
        run.start_loader()  # its workers start while the state is made
        if OVERLAP_COMPILES:
            run.train_call  # compiles beside the initialization's own program
        state = program.init_state(init_from.load_params(cfg, program.layout))
        run.train_call  # compiles while the host finishes the start-up (the summary, wandb, the first batches)
        return Restored(0, state)
    step, saved, state = found
    if state is None:
        say(f"{run.run_dir.path}: already finished at step {step}; train.steps={cfg.train.steps}."
            f" {extension_hint(saved, step)}")
        return Restored(step, finished=True)
    say(f"resumed from {run.ckpt.path(step)}")
    return Restored(step, state, saved)


@contextlib.contextmanager
def another_run_hint(run: RunContext):
    """A checkpoint of another model or corpus: most often a new experiment started on the run directory of an
    earlier one (the default's), so the refusal names a fresh --run_dir."""
    try:
        yield
    except CheckpointMismatch as e:
        raise CheckpointMismatch(f"{e}. This run directory holds another run: start this one in a fresh --run_dir"
                                 f" (e.g. --run_dir={fresh_run_dir(run.run_dir.path)}), or give that run's"
                                 " settings to resume it") from None


def fresh_run_dir(path) -> str:
    """The first of <path>_2, <path>_3, ... that does not exist yet."""
    n = 2
    while path.parent.joinpath(f"{path.name}_{n}").exists():
        n += 1
    return str(path.parent / f"{path.name}_{n}")


def extension_hint(saved: dict, step: int) -> str:
    """How to extend a run that finished at `step` on the same learning-rate schedule (which
    `check_same_schedule` requires)."""
    hint = config_from_meta(saved, f"checkpoint {step}").schedule.extension_hint(step)
    return f"To continue it: {hint} (docs/training.md)"


def restore_state(run: RunContext, step: int, saved: dict) -> dict:
    """The checkpoint's train state (from any release of this trainer: see TrainProgram.restore_target)."""
    target, upgrade = run.program.restore_target(saved)
    return upgrade(run.ckpt.restore(step, target))


def check_same_schedule(saved: dict, config: Config, where) -> None:
    """Refuses a resume that would change how any parameter learns from the resumed step on — any optimizer or
    schedule field (each whole config compared, so a new field is covered by being one), or the run's length where
    the schedule follows it — unless train.reschedule is set."""
    if config.train.reschedule or "config" not in saved:
        return
    old = config_from_meta(saved, where)
    before = {"optim": dataclasses.asdict(old.optim), "schedule": old.schedule.curve(old.train.steps)}
    now = {"optim": dataclasses.asdict(config.optim), "schedule": config.schedule.curve(config.train.steps)}
    changed = [f"{section}.{k}: {before[section].get(k)} -> {now[section].get(k)}" for section in before
               for k in sorted(before[section].keys() | now[section].keys())
               if before[section].get(k) != now[section].get(k)]
    if changed:
        keep = "keep the old values"
        if before["schedule"] != now["schedule"]:
            keep += f" (to extend a run on its old schedule: {old.schedule.extension_hint(old.train.steps)})"
        raise CheckpointMismatch(f"{where}: resuming would change the optimizer or its schedule"
                                 f" ({'; '.join(changed)}); {keep}, or pass --train.reschedule=True to accept"
                                 " the change")
