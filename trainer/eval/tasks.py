"""The lm-evaluation-harness tasks a run asks for (`train.eval_tasks`, `eval.py --tasks`), checked before any work:
lm-eval installed, every task known, its documents loadable (a hub dataset with no network is one line here, not
an error at the first evaluation)."""

from __future__ import annotations

from errors import ConfigError


def check_tasks(tasks: str, include_path: str | None, flags: tuple[str, str]) -> None:
    """`flags`: the two settings' names as the user gave them (tasks, include path), for the errors."""
    try:
        from trainer.eval.harness import check_tasks_load  # lm-eval: the optional `eval` extra
    except ImportError:
        raise ConfigError(f"{flags[0]} needs lm-evaluation-harness: pip install -e '.[eval]'") from None
    check_tasks_load(tasks, include_path, flags)
