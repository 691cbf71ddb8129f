"""Cloud storage that falters: every request of this process retries transient failures for a budget in
seconds, an outage is reported once when it begins and once when it ends, and a request that receives no byte
for `storage.request_timeout` fails (and is retried) instead of hanging every process of the job.

Two clients talk to GCS: gcsfs (through `etils.epath`: the run directory's files, the lock, Orbax's metadata) and
TensorStore (Orbax's arrays). Each gets the same budget and timeout here. No JAX: the corpus writer and the
storage tests import this without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import importlib.util
import math
import os
import random
import time
from typing import Iterator

from errors import first_line, warn

_retry = {"budget": 600.0, "since": None}  # the retry budget (seconds); when the current outage began
# A request made while another one is being retried (the check whether a lost compose landed) gets what is left
# of that one's budget, not a budget of its own: set in that request's asyncio task only.
_budget_left: contextvars.ContextVar[float | None] = contextvars.ContextVar("budget_left", default=None)


def retry_storage_for(budget: float, request_timeout: float) -> None:
    """Every cloud-storage request of this process (the trainer's files, the lock, Orbax's metadata through
    gcsfs; its arrays through TensorStore) retries transient failures (HTTP 429/5xx, a refused or reset
    connection, a timeout) with exponential backoff for up to `budget` seconds before it fails. An outage is
    reported once, when it starts, and once when it ends.

    gcsfs retries a request 6 times (~30 s) with no setting to change it, so its request method's own retry
    decorator is replaced here by one with a budget in seconds (the same retriable errors: gcsfs's
    `is_retriable`); TensorStore takes its retry limits from its context, which Orbax builds from a
    module-level default, and its timeout from the environment. A request that receives no byte for
    `request_timeout` seconds fails and is retried in both.
    """
    _retry["budget"] = float(budget)
    _tensorstore_limits(budget, request_timeout)
    if importlib.util.find_spec("gcsfs") is None:  # the optional `gcs` extra: imported only where it is installed
        return
    import aiohttp
    import fsspec
    import gcsfs

    # gcsfs waits forever for an answer by default: a stalled connection would hang every process of the job.
    # The filesystems made from now on (fsspec's defaults for "gcs") fail such a request, and it is retried.
    fsspec.config.conf.setdefault("gcs", {})["requests_timeout"] = aiohttp.ClientTimeout(
        sock_connect=request_timeout, sock_read=request_timeout)

    request = gcsfs.GCSFileSystem._request
    if not getattr(request, "budgeted", False):
        gcsfs.GCSFileSystem._request = _budgeted(getattr(request, "__wrapped__", request))


def _budgeted(request):
    from gcsfs.retry import is_retriable  # the `gcs` extra: only reached once retry_storage_for found it

    @functools.wraps(request)
    async def retried(self, *args, _took_effect=None, **kwargs):
        """`_took_effect`: for a request that must not be made twice (an append's compose), an async check,
        asked before each retry and before its failure is reported, whether a failed attempt (its answer lost)
        was carried out after all: a record must never be both written and reported failed."""
        delay, started = 1.0, time.monotonic()
        budget = _budget_left.get()
        budget = _retry["budget"] if budget is None else budget
        left = lambda: max(0.0, budget - (time.monotonic() - started))  # noqa: E731
        while True:
            try:
                result = await request(self, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - what may be retried is gcsfs's own judgement
                if not is_retriable(e):
                    raise
                if left() <= 0:
                    if _took_effect is not None and await _landed(_took_effect, 0.0):  # one look, then the error
                        _outage_ended()
                        return LOST_ANSWER
                    raise
                _outage_began(e)
                await asyncio.sleep(min(delay, left() + 0.1))
                delay = min(2 * delay, 30.0) * (0.75 + 0.5 * random.random())
                if _took_effect is not None and await _landed(_took_effect, left()):
                    _outage_ended()
                    return LOST_ANSWER
                continue
            _outage_ended()
            return result

    retried.budgeted = True
    return retried


LOST_ANSWER = (200, {}, None, b"{}")  # what gcsfs's `_call` unpacks for a request that landed, its answer lost


async def _landed(took_effect, budget: float) -> bool:
    """Whether the failed request was carried out, asked within `budget` seconds of retries; False when the
    store cannot say (the request's own error is then reported)."""
    token = _budget_left.set(budget)
    try:
        return await took_effect()
    except Exception:  # noqa: BLE001 - no answer: the request's own error is the one to report
        return False
    finally:
        _budget_left.reset(token)


def retry_budget() -> float:
    """Seconds a failing request is retried for (storage.retry_seconds; 0 inside `without_retries`)."""
    return _retry["budget"]


@contextlib.contextmanager
def without_retries() -> Iterator[None]:
    """One attempt per request: for what a failing run does on its way out (releasing the lock), which must
    not wait out the retry budget; a lock left behind is taken over at the next start."""
    budget, _retry["budget"] = _retry["budget"], 0.0
    try:
        yield
    finally:
        _retry["budget"] = budget


def outage_note() -> str:
    """What to add to a storage error met during an outage: how long it was retried, and the flag."""
    if _retry["since"] is None:
        return ""
    return f" (cloud storage unavailable for {time.monotonic() - _retry['since']:.0f} s; storage.retry_seconds)"


def _outage_began(e: BaseException) -> None:
    if _retry["since"] is None:
        _retry["since"] = time.monotonic()
        warn(f"cloud storage request failed ({first_line(e, 120)}); retrying for up to {_retry['budget']:.0f} s"
             " (storage.retry_seconds)")


def _outage_ended() -> None:
    if _retry["since"] is not None:
        warn(f"cloud storage answers again after {time.monotonic() - _retry['since']:.0f} s")
        _retry["since"] = None


def _tensorstore_limits(budget: float, request_timeout: float) -> None:
    """TensorStore's GCS retries (default: 32 attempts, 1 s to 32 s apart): as many as fit in `budget`; a
    request that receives no byte for `request_timeout` fails (then is retried) instead of waiting for
    TensorStore's own limit (~60 s, measured on a silent socket).

    The timeout is curl's low-speed limit, read by TensorStore from the environment when it makes its first
    HTTP transport (JAX sets 60 s itself, on Cloud TPU VMs only); so it holds for processes that have not yet
    touched gs:// through TensorStore. The flag replaces what the environment had: it is the one setting.
    """
    os.environ["TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS"] = str(max(1, math.ceil(request_timeout)))
    os.environ["TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES"] = "1"
    try:
        from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils  # imports JAX: deferred
    except ImportError:
        return
    attempts, waited, delay = 0, 0.0, 1.0
    while waited < budget:
        waited, delay, attempts = waited + delay, min(2 * delay, 32.0), attempts + 1
    retries = {"max_retries": max(attempts, 1), "initial_delay": "1s", "max_delay": "32s"}
    for context in (ts_utils._BASE_TS_CONTEXT, ts_utils._DEFAULT_OCDBT_TS_CONTEXT):  # noqa: SLF001
        context["gcs_request_retries"] = retries
