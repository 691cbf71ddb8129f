"""The application's errors: each is a user's mistake or an environment fault, reported as one `error:` line
and exit status 2 by the entry points (train.py, eval.py, `python -m data.prepare`).

This module imports nothing, so `data.prepare` can raise these without loading JAX. The model package
raises its own `gpt2.config.ConfigError` (a bad architecture, mesh or rules table); the entry points catch
both.
"""

from __future__ import annotations


class UserError(Exception):
    """Something the user can fix; the message names the flag, file or path and what to do."""


class ConfigError(UserError, ValueError):
    """A configuration value or command-line argument is invalid; the message names the flag."""


class DataError(UserError, ValueError):
    """Bad or missing data; the message names the path and the problem."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be used for this run; the message says why."""


class RunDirError(UserError, OSError):
    """The run directory cannot be used (held by another trainer, unwritable, full, corrupt files)."""
