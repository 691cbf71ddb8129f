"""Library log records (absl / Python logging from Orbax, Grain, JAX, gcsfs), their warnings and exceptions raised
where nothing can catch them go to the run directory's `logs/process_<i>.log`, not the console."""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import jax
from absl import logging as absl_logging

from errors import RUN_LOG, first_line, warn
from trainer.storage.files import append, is_remote, oserror_reason


@contextlib.contextmanager
def library_logs_to(directory) -> Iterator[None]:
    """Sends library log records (absl / Python logging: Orbax, Grain, JAX, gcsfs) to
    <directory>/process_<i>.log instead of the console, where a failing background write would print hundreds
    of lines before the one line that says what happened; so do unraisable exceptions (tensorstore's callbacks
    that find Orbax's event loop closed after a failed restore print a traceback each). A log that cannot be
    created there (a read-only run directory, e.g. a mounted bucket that eval.py reads) goes to the temporary
    directory instead, said at exit; one that cannot be written (full disk) is dropped silently. On cloud storage
    the records go to a local temporary file that is appended to the log object at exit (a process killed
    with -9 leaves it in the temporary directory instead)."""
    name = f"process_{jax.process_index()}.log"
    local, failing = None, False
    elsewhere = os.path.join(tempfile.gettempdir(), f"gpt2-nnx-{os.getpid()}-{name}")  # made at the first record
    if is_remote(directory):
        local = elsewhere
        handler = logging.FileHandler(local, delay=True)
    else:
        try:
            directory.mkdir(exist_ok=True)  # inside an existing run directory only
            handler = _LogFile(str(directory / name), elsewhere)
        except FileNotFoundError:  # no run directory (the program is about to say so)
            handler = logging.NullHandler()
        except OSError:
            handler = _LogFile(str(directory / name), elsewhere)  # refused at the first record
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root, absl_handler = logging.getLogger(), absl_logging.get_absl_handler()
    saved = (list(root.handlers), absl_handler.level, logging.raiseExceptions, sys.unraisablehook)
    for h in saved[0]:
        root.removeHandler(h)
    root.addHandler(handler)
    # the run's own lines beside the libraries' (errors.py), held back until the run goes ahead (`keep_run_log`): a
    # start refused before any work, or a finished run started again, leaves the run directory as it was
    global _run_lines
    _run_lines = logging.handlers.MemoryHandler(capacity=100_000, flushLevel=logging.CRITICAL + 1, target=handler,
                                                flushOnClose=False)
    RUN_LOG.addHandler(_run_lines)
    absl_handler.setLevel(logging.CRITICAL + 1)  # absl's own stderr handler
    logging.raiseExceptions = False  # a full disk must not print "--- Logging error ---" blocks
    sys.unraisablehook = _unraisable_to_log
    logging.captureWarnings(True)  # libraries' warnings.warn (JAX's notes on its compilation cache) too
    try:
        yield
    except BaseException as e:
        RUN_LOG.error(first_line(e))  # how the run ended, in its log too (the console gets it once, later)
        # Failing: background threads (Orbax's writers) may still log their side of it; they must not reach
        # the console either, so the console handlers stay detached.
        root.addHandler(logging.NullHandler())
        failing = True
        raise
    else:
        for h in saved[0]:
            root.addHandler(h)
        absl_handler.setLevel(saved[1])
        logging.raiseExceptions = saved[2]
        sys.unraisablehook = saved[3]
        logging.captureWarnings(False)
    finally:
        root.removeHandler(handler)
        RUN_LOG.removeHandler(_run_lines)
        _run_lines.close()
        with contextlib.suppress(OSError):
            handler.close()
        if local is not None:
            _upload_log(local, directory / name, quiet=failing)
        if getattr(handler, "moved", None) and not failing:  # failing: the error is the one line to print
            warn(f"{handler.moved} {handler.elsewhere}")


_run_lines: logging.handlers.MemoryHandler | None = None


def keep_run_log() -> None:
    """The run goes ahead: its lines so far, and from now on every one, go to its log."""
    if _run_lines is not None:
        _run_lines.capacity = 0  # each record flushes
        _run_lines.flush()


class _LogFile(logging.FileHandler):
    """A log file opened at its first record, or where that fails, `elsewhere` (`moved` says why)."""

    def __init__(self, path: str, elsewhere: str):
        super().__init__(path, delay=True)
        self.elsewhere = elsewhere
        self.moved: str | None = None

    def _open(self):
        try:
            return super()._open()
        except OSError as e:
            if self.baseFilename == self.elsewhere:
                return open(os.devnull, "a")  # nowhere to write: dropped
            self.moved = f"cannot write library logs to {self.baseFilename} ({oserror_reason(e)}); they are in"
            self.baseFilename = self.elsewhere
            return self._open()


def _unraisable_to_log(unraisable) -> None:
    """An exception raised where nothing can catch it (a library's callback on another thread): logged."""
    info = (unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback)
    where = "" if unraisable.object is None else f" in {unraisable.object!r}"
    logging.getLogger("unraisable").warning("%s%s", unraisable.err_msg or "Exception ignored", where, exc_info=info)


def _upload_log(local: str, target, *, quiet: bool) -> None:
    """Appends a local log file to its object and removes it; a log that cannot be uploaded stays local (said
    in a warning, unless the run is failing: then its own error is the one line to print)."""
    try:
        if os.path.exists(local):
            append(target, Path(local).read_bytes())
            os.remove(local)
    except Exception as e:  # noqa: BLE001 - a storage error here must not replace the run's own outcome
        if not quiet:
            warn(f"library logs not uploaded to {target} ({oserror_reason(e)}); they are in {local}")
