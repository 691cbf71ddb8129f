"""Where a start begins: the newest checkpoint that restores and fits this run, or a fresh (or fine-tune's
imported) state. A resumed run continues exactly: the same parameters, optimizer moments, step, RNG and
data position as if it had never stopped.
"""

from __future__ import annotations

import dataclasses

from configs.base import Config
from trainer.processes import say
from trainer.run import data_position, init_from
from trainer.run.context import RunContext
from trainer.storage.checkpoints import CheckpointMismatch, check_compatible


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
        check_compatible(saved, cfg, run.ckpt.path(step))
        if step >= cfg.train.steps:
            return None
        data_position.check_same_data(saved, cfg, run.corpus, run.ckpt.path(step))
        check_same_schedule(saved, cfg, run.ckpt.path(step))
        state = restore_state(run, step, saved)
        data_position.restore(run.ckpt, step, run.train_iter)
        data_position.realign(saved, cfg, run.train_iter, run.ckpt.path(step))
        return state

    found = run.ckpt.restore_latest(attempt)
    if found is None:
        if cfg.init_from:
            say(f"initialized from {cfg.init_from} (Hugging Face weights; fresh optimizer)")
        return Restored(0, program.init_state(init_from.load_params(cfg, program.layout)))
    step, saved, state = found
    if state is None:
        say(f"{run.run_dir.path}: already finished at step {step}; train.steps={cfg.train.steps}."
            f" {extension_hint(saved, step)}")
        return Restored(step, finished=True)
    say(f"resumed from {run.ckpt.path(step)}")
    return Restored(step, state, saved)


def extension_hint(saved: dict, step: int) -> str:
    """How to extend a run that finished at `step`: more steps, on the same learning-rate schedule (which
    `check_same_schedule` requires): with optim.decay_steps unset the cosine ended at train.steps, so it is fixed
    there and the rate stays at its final value."""
    if saved.get("config", {}).get("optim", {}).get("decay_steps"):
        return "To continue it: --train.steps=MORE (docs/training.md)"
    return (f"To continue it: --train.steps=MORE --optim.decay_steps={step} (the learning rate stays at its final"
            " value; --train.reschedule=True instead for a new cosine; docs/training.md)")


def restore_state(run: RunContext, step: int, saved: dict) -> dict:
    """The checkpoint's train state (from any release of this trainer: see TrainProgram.restore_target)."""
    target, upgrade = run.program.restore_target(saved)
    return upgrade(run.ckpt.restore(step, target))


def check_same_schedule(saved: dict, config: Config, where) -> None:
    """Refuses a resume that would change the learning-rate schedule, unless train.reschedule is set."""
    if config.train.reschedule:
        return
    old = saved.get("config", {})
    o, t = old.get("optim", {}), old.get("train", {})
    if not o or "steps" not in t:
        return
    before = {"optim.lr": o.get("lr"), "optim.min_lr_ratio": o.get("min_lr_ratio"),
              "optim.warmup_steps": o.get("warmup_steps"), "decay": o.get("decay_steps") or t.get("steps")}
    c = config.optim
    now = {"optim.lr": c.lr, "optim.min_lr_ratio": c.min_lr_ratio, "optim.warmup_steps": c.warmup_steps,
           "decay": c.decay_steps or config.train.steps}
    changed = [k for k in before if before[k] != now[k]]
    if changed:
        name = {"decay": "optim.decay_steps (train.steps when unset)"}
        fields = "; ".join(f"{name.get(k, k)}: {before[k]} -> {now[k]}" for k in changed)
        keep = (f"keep the old values (to extend a run on its old schedule: --optim.decay_steps={before['decay']})"
                if "decay" in changed else "keep the old values")
        raise CheckpointMismatch(f"{where}: resuming would change the learning-rate schedule ({fields}); {keep},"
                                 " or pass --train.reschedule=True to accept the change")
