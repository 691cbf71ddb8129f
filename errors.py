"""The application's errors: each is a user's mistake or an environment fault, reported as one `error:` line and
exit status 2 by every entry point (train.py, eval.py, `python -m data.prepare`, `python -m tools.export_hf`).

Grouped by what went wrong. This module imports nothing, so every package (the model in `gpt2/`, the corpus
writer in `data/` that must start without JAX) raises these same classes.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
from typing import Callable

# The run's own lines (start-up, warnings, the error it ends with), also written to its log (logs/process_<i>.log)
# while trainer/telemetry/library_logs.py holds the log open; nowhere else (no console handler: printing is ours).
RUN_LOG = logging.getLogger("gpt2_nnx")
RUN_LOG.propagate = False
RUN_LOG.addHandler(logging.NullHandler())
RUN_LOG.setLevel(logging.INFO)


class UserError(Exception):
    """Something the user can fix; the message names the flag, file or path and what to do."""

    # True when background threads (Orbax's writers) are mid-failure: the program must end at once, since an
    # orderly interpreter shutdown would join them and bury the one line under their tracebacks.
    abandon_threads = False


class ConfigError(UserError, ValueError):
    """A configuration value or command-line argument is invalid; the message names the flag."""


class DataError(UserError, ValueError):
    """Bad or missing data; the message names the path and the problem."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint (ours or a Hugging Face one) cannot be used for this run; the message says why."""


class StorageError(UserError, OSError):
    """The run directory or its storage cannot be used (held by another trainer, unwritable, full, corrupt)."""


class TrainingError(UserError, RuntimeError):
    """The run itself failed (diverged, or a checkpoint could not be written); the newest good checkpoint is
    named in the message."""


def first_line(e: BaseException, limit: int = 300) -> str:
    """An exception as a one-line reason: its message's first line, or its type's name when it has none. Long
    bracketed payloads are dropped (TensorStore appends `[tensorstore_spec='{...}']`, a kilobyte of JSON, after
    the reason); a line still longer than `limit` keeps its start and its end (where libraries put the reason
    after a long path)."""
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    line = _PAYLOAD.sub(lambda m: "" if len(m.group()) > 80 else m.group(), line)
    return line if len(line) <= limit else f"{line[: limit // 2]} ... {line[-(limit // 2):]}"


_PAYLOAD = re.compile(r" ?\[\w[\w ]*='[^']*'\]")  # absl status payloads: [name='value']


def warn(message: str) -> None:
    """One `warning:` line on stderr, from whichever process met it (a storage outage, a damaged checkpoint moved
    aside): the run goes on."""
    print(f"warning: {message}", file=sys.stderr, flush=True)
    RUN_LOG.warning(message)


def fail(message: str):
    """Ends the program with one `error:` line and exit status 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def one_line_errors(main: Callable[..., int]) -> Callable[..., int]:
    """An entry point whose user-facing errors end it with one line and exit status 2, never a traceback."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except UserError as e:
            if e.abandon_threads:
                print(f"error: {e}", file=sys.stderr, flush=True)
                os._exit(2)
            fail(str(e))

    return wrapped
