"""Faults through the real train.py / eval.py: kills, signals, a second trainer, damaged checkpoints and
metrics, reruns, divergence, storage errors, device-count changes.

One uninterrupted reference run per module (8 devices, a checkpoint every 2 steps, all kept);
each case starts from a copy of its run directory rewound to a checkpoint, and compares with it. Cases that
need a real process to die are subprocesses; the others call train.main / eval.main in-process (the same
8 devices, so their losses are bitwise the reference's).
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import eval as eval_app
import train as train_app
from support.cli import (
    ROOT,
    SMALL,
    checkpoint_steps,
    cli_env,
    last_line,
    private_compile_cache,
    read_jsonl,
    read_only,
    rewound,
    run_cli,
    run_main,
    step_losses,
    without_timing,
)
from trainer.storage.run_dir import RunDir
from trainer.telemetry import goodput

# 2 steps per call, a checkpoint after every call (all kept), an evaluation every 8 steps
FAULT = [*SMALL, "--train.steps=16", "--checkpoint.every=2", "--checkpoint.keep=10", "--train.eval_every=8"]


def args(run_dir, shakespeare, *extra):
    return ["--run_dir", str(run_dir), f"--data.cache_dir={shakespeare}", *FAULT, *extra]


def records(run_dir):
    """metrics.jsonl without the timing fields: what an exact resume must reproduce."""
    return without_timing(read_jsonl(run_dir / "metrics.jsonl"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, shakespeare):
    run_dir = tmp_path_factory.mktemp("reference")
    r = run_cli("train.py", *args(run_dir, shakespeare))
    assert r.returncode == 0, r.stderr[-3000:]
    assert checkpoint_steps(run_dir) == list(range(2, 17, 2))
    return run_dir


def train_in_process(run_dir, shakespeare, *extra):
    code, out, err = run_main(train_app.main, *args(run_dir, shakespeare, *extra))
    return code, out, err


# A process under a file-size limit from its start must not write (truncated) entries into the session's
# compilation cache (one limited mid-run loads from a private copy of it: support.cli.private_compile_cache).
NO_CACHE = {"JAX_ENABLE_COMPILATION_CACHE": "false"}


def start(run_dir, shakespeare, *extra, devices=8, env=None):
    return subprocess.Popen([sys.executable, "train.py", *args(run_dir, shakespeare, *extra)], cwd=ROOT,
                            env=cli_env(devices, env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(condition, proc, timeout=300):
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, f"train.py ended early:\n{proc.stderr.read()[-3000:]}"
        assert time.time() < deadline, "timed out waiting for the run to reach the fault point"
        time.sleep(0.02)


def n_steps_logged(run_dir):
    path = run_dir / "metrics.jsonl"
    return len([line for line in path.read_text().splitlines() if '"loss"' in line]) if path.exists() else 0


def resume_and_compare(run_dir, shakespeare, reference):
    """Restarts in-process and checks the whole metrics file against the uninterrupted run's."""
    code, out, err = train_in_process(run_dir, shakespeare)
    assert code == 0, err[-3000:]
    assert records(run_dir) == records(reference)  # every step once, bitwise losses, same evaluations
    return out, err


# ---- kill -9, and a second trainer on the same run directory ------------------------------------


def steps_recorded(run_dir):
    """The last step of the train calls events.jsonl records (the goodput record, written just after a call's
    metrics lines: a kill between the two leaves that call out of it). A line being written is left out."""
    records, _ = RunDir(run_dir).load_events(say_torn=False)
    return max((r["first"] + r["steps"] for r in records if r["event"] == "train_call"), default=0)


def _mid_save(run_dir):
    ckpt = run_dir / "checkpoints"
    return ckpt.exists() and any("tmp" in p.name for p in ckpt.iterdir())


def _mid_eval(run_dir):
    """Step 8's call recorded (the evaluation at step 8 comes next) and no validation loss logged yet."""
    path = run_dir / "metrics.jsonl"
    return steps_recorded(run_dir) >= 8 and "val_loss" not in path.read_text()


@pytest.mark.parametrize("point", ["between_steps", "during_async_save", "during_eval"])
def test_kill_9_then_restart_continues_exactly(tmp_path, shakespeare, reference, point):
    run_dir = rewound(reference, tmp_path, 2)
    extra = ["--train.eval_batches=200"] if point == "during_eval" else []  # a long evaluation to land in
    proc = start(run_dir, shakespeare, *extra)
    condition = {
        "between_steps": lambda: steps_recorded(run_dir) >= 5,
        "during_async_save": lambda: steps_recorded(run_dir) >= 4 and _mid_save(run_dir),
        "during_eval": lambda: _mid_eval(run_dir),
    }[point]
    wait_for(condition, proc)
    if point == "between_steps":  # a second trainer on a run directory in use: refused at once
        holder = (run_dir / ".lock.json").read_text()
        code, _, err = run_main(train_app.main, *args(run_dir, shakespeare))
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"{run_dir} is in use by another trainer (host " in err and f"pid {proc.pid}, started " in err
        assert (run_dir / ".lock.json").read_text() == holder
    proc.kill()
    proc.wait()
    steps_before, computed, recorded = checkpoint_steps(run_dir), n_steps_logged(run_dir), steps_recorded(run_dir)
    assert recorded <= computed <= recorded + 2  # the kill may land between a call's (2 steps) two writes
    out, err = resume_and_compare(run_dir, shakespeare, reference)
    report = goodput.report(read_jsonl(run_dir / "events.jsonl"))
    assert [a["how"] for a in report.attempts] == ["crashed", "finished"]
    assert report.lost_steps == recorded - steps_before[-1]  # the recorded steps after the checkpoint resumed from
    assert f"resumed from {run_dir / 'checkpoints' / str(steps_before[-1])}" in out
    assert not any("tmp" in p.name for p in (run_dir / "checkpoints").iterdir())
    if point == "between_steps":  # the dead trainer's lock was taken over, with one line naming it
        assert "taking over the lock of a trainer that did not exit cleanly (host" in err and str(proc.pid) in err


def test_a_torn_last_metrics_line_is_repaired_on_resume(tmp_path, shakespeare, reference):
    run_dir = rewound(reference, tmp_path, 10)
    for name, torn in (("metrics.jsonl", '{"step": 11, "loss": 6.1'), ("events.jsonl", '{"event": "train_ca')):
        with open(run_dir / name, "a") as f:
            f.write(torn)  # a kill or a full disk in the middle of a write
    out, err = resume_and_compare(run_dir, shakespeare, reference)
    assert "metrics.jsonl: dropped a torn last line" in err and "resumed from" in out
    assert err.count("events.jsonl: dropped a torn last line") == 1, err  # said once, when it is repaired
    # the torn record is gone from the file (read_jsonl would fail on it); the resume's attempt is recorded
    assert [a["how"] for a in goodput.report(read_jsonl(run_dir / "events.jsonl")).attempts] == ["finished"]


# ---- signals ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_the_current_step_and_exits_0(tmp_path, shakespeare, reference, sig):
    run_dir = rewound(reference, tmp_path, None)
    proc = start(run_dir, shakespeare, "--checkpoint.every=1000")
    wait_for(lambda: n_steps_logged(run_dir) >= 4, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    step = n_steps_logged(run_dir)
    assert checkpoint_steps(run_dir) == [step]
    assert f"stopped by {sig.name} at step {step}; checkpoint saved, restart to resume" in out
    resume_and_compare(run_dir, shakespeare, reference)
    report = goodput.report(read_jsonl(run_dir / "events.jsonl"))
    assert [a["how"] for a in report.attempts] == ["preempted", "finished"] and report.lost_steps == 0


def test_a_finished_run_accounts_for_its_wall_time(reference):
    """No fault: nothing lost, badput is start-up, compilation, checkpoint saves and evaluations, and the
    recorded categories cover the wall time to within 1 %."""
    report = goodput.report(read_jsonl(reference / "events.jsonl"))
    assert [a["how"] for a in report.attempts] == ["finished"]
    assert (report.good_steps, report.lost_steps, report.skipped_steps) == (16, 0, 0)
    assert all(report.seconds[name] > 0 for name in ("startup", "compile", "checkpoint", "eval", "train"))
    records = read_jsonl(reference / "events.jsonl")
    assert abs(report.unaccounted) <= 0.01 * report.wall, f"{report.text()}\nlargest gaps: {_gaps(records)[-3:]}"


def _gaps(records):
    """The times between recorded intervals, smallest first: (seconds, after what, before what)."""
    spans = sorted((r["start"], r["end"], r.get("kind", r["event"])) for r in records if "start" in r)
    gaps, reach, last = [], records[0]["time"], "attempt_start"
    for start, end, kind in spans:
        if start > reach:
            gaps.append((round(start - reach, 3), last, kind))
        if end > reach:
            reach, last = end, kind
    return sorted(gaps)


# ---- damaged checkpoints ----------------------------------------------------------------------------


def _array_files(run_dir, step):
    return sorted(p for p in (run_dir / "checkpoints" / str(step) / "state").rglob("*")
                  if p.is_file() and "/d/" in str(p))


def _truncate_array(run_dir):  # every array data file: which holds the parameters is OCDBT's business
    for f in _array_files(run_dir, 16):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _delete_array(run_dir):
    for f in _array_files(run_dir, 16):
        f.unlink()


def _truncate_meta(run_dir):
    (run_dir / "checkpoints" / "16" / "meta" / "metadata").write_text('{"config": {"mod')


def _garble_data(run_dir):
    (run_dir / "checkpoints" / "16" / "data" / "process_0-of-1.json").write_text("garbage")


def _foreign_dir(run_dir):
    (run_dir / "checkpoints" / "500").mkdir()
    (run_dir / "checkpoints" / "500" / "notes.txt").write_text("not a checkpoint")


@pytest.mark.parametrize("damage", [_truncate_array, _delete_array, _truncate_meta, _garble_data, _foreign_dir])
def test_a_damaged_latest_checkpoint_is_moved_aside_and_the_previous_one_resumes(tmp_path, shakespeare, reference,
                                                                                  damage):
    run_dir = rewound(reference, tmp_path, 16)
    damage(run_dir)
    bad = max(checkpoint_steps(run_dir))
    # eval.py names the damaged checkpoint and the steps there are (it reads no data-iterator state)
    code, _, err = run_main(eval_app.main, "--run_dir", str(run_dir), "--batches", "1", "--no-wandb")
    if damage is _garble_data:
        assert code == 0, err[-2000:]
    else:
        assert code == 2 and len(err.strip().splitlines()) == 1, err[-2000:]
        assert str(run_dir / "checkpoints" / str(bad)) in err and "checkpoints in this run: [2, 4," in err
    # train.py moves it aside (never deletes it) and resumes from the previous one: bitwise the reference's
    code, out, err = train_in_process(run_dir, shakespeare, "--train.steps=18")
    assert code == 0, err[-3000:]
    warning = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert len(warning) == 1 and f"{run_dir / 'checkpoints' / str(bad)}: " in warning[0], err[-2000:]
    previous = 16 if damage is _foreign_dir else 14
    assert f"resumed from {run_dir / 'checkpoints' / str(previous)}" in out
    moved = list((run_dir / "checkpoints.damaged").iterdir())
    assert len(moved) == 1 and moved[0].name.startswith(f"{bad}-")
    assert step_losses(run_dir)[:16] == step_losses(reference)


def test_eval_all_keeps_going_past_damaged_and_removed_checkpoints(tmp_path, reference, monkeypatch):
    from trainer.storage.checkpoints import Checkpoints

    run_dir = rewound(reference, tmp_path, 8)
    for f in _array_files(run_dir, 6):  # damaged: every array data file (how OCDBT splits them varies by run)
        f.unlink()
    restore = Checkpoints.restore_params

    def rotating(self, step, abstract):  # a trainer deleting checkpoint 4 while checkpoint 2 is evaluated
        if step == 2:
            shutil.rmtree(run_dir / "checkpoints" / "4")
        return restore(self, step, abstract)

    monkeypatch.setattr(Checkpoints, "restore_params", rotating)
    code, out, err = run_main(eval_app.main, "--run_dir", str(run_dir), "--all", "--batches", "1", "--no-wandb")
    assert code == 2, err[-2000:]
    assert f"{run_dir / 'checkpoints' / '4'}: removed while evaluating" in err
    assert f"{run_dir / 'checkpoints' / '6'}: cannot be restored" in err
    assert last_line(err) == ("error: 1 of 4 checkpoints could not be evaluated (steps [6]); the others' results"
                              " are saved")
    saved = json.loads((run_dir / "eval.json").read_text())["results"]
    assert sorted(r["step"] for r in saved) == [2, 8]


# ---- eval results ---------------------------------------------------------------------------------------


def test_eval_json_keeps_results_of_different_settings(tmp_path, reference):
    run_dir = rewound(reference, tmp_path, 16)
    for batches in ("1", "2", "1"):
        code, _, err = run_main(eval_app.main, "--run_dir", str(run_dir), "--batches", batches, "--no-wandb")
        assert code == 0, err
    results = json.loads((run_dir / "eval.json").read_text())["results"]
    assert sorted((r["step"], r["batches"]) for r in results) == [(16, 1), (16, 2)]
    (run_dir / "eval.json").write_text('{"12": {"val_loss": 5.0}}')  # a foreign or old-format file
    code, _, err = run_main(eval_app.main, "--run_dir", str(run_dir), "--batches", "1", "--no-wandb")
    assert code == 2 and last_line(err) == (f"error: {run_dir / 'eval.json'}: not an eval.json written by eval.py;"
                                            " move it away or pass another --out")


# ---- divergence ---------------------------------------------------------------------------------------


def test_divergence_stops_with_the_step_and_every_checkpoint_left_is_finite(tmp_path, shakespeare, reference):
    """A healthy run to step 4, then an absurd learning rate: it stops at the first non-finite loss, and
    the checkpoints it leaves (2 and 4) evaluate to finite numbers."""
    run_dir = rewound(reference, tmp_path, 4)
    code, _, err = train_in_process(run_dir, shakespeare, "--optim.lr=1e30", "--train.reschedule=True")
    assert code == 2
    message = last_line(err)
    assert message.startswith("error: training diverged at step ") and "last good checkpoint" in message
    diverged_at = int(message.split("step ")[1].split(" ")[0])
    saved = checkpoint_steps(run_dir)
    assert saved == [2, 4] and diverged_at > 4
    for step in saved:
        code, _, err = run_main(eval_app.main, "--run_dir", str(run_dir), "--step", str(step), "--batches", "1",
                                "--no-wandb")
        assert code == 0, err[-2000:]
    assert all(np.isfinite(r["val_loss"]) for r in json.loads((run_dir / "eval.json").read_text())["results"])


# ---- storage ------------------------------------------------------------------------------------------


def test_full_disk_while_saving_is_a_clear_error_and_keeps_older_checkpoints(tmp_path, shakespeare, reference):
    run_dir = rewound(reference, tmp_path, 4)
    proc = start(run_dir, shakespeare, "--checkpoint.async_save=False", env=private_compile_cache(tmp_path))
    wait_for(lambda: n_steps_logged(run_dir) >= 5, proc)
    # from now on no file of this process may grow beyond 64 KB: the next save's array files (megabytes) hit
    # EFBIG, like a full disk, while the run directory's logs (a few KB) still grow
    subprocess.run(["prlimit", f"--pid={proc.pid}", "--fsize=65536"], check=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-3000:]
    assert len(err.strip().splitlines()) == 1, err[-3000:]  # no tracebacks from Orbax's threads
    assert last_line(err).startswith("error: could not save checkpoint") and "File too large" in err
    kept = checkpoint_steps(run_dir)
    code, _, err = run_main(eval_app.main, "--run_dir", str(run_dir), "--step", str(kept[-1]), "--batches", "1",
                            "--no-wandb")
    assert code == 0, err[-2000:]


@pytest.mark.parametrize("where", ["run_dir", "checkpoints"])
def test_a_read_only_run_dir_or_checkpoints_dir_is_one_line_at_once(tmp_path, shakespeare, reference, where):
    run_dir = rewound(reference, tmp_path, 4)
    target = run_dir if where == "run_dir" else run_dir / "checkpoints"
    with read_only(target):
        started = time.time()
        code, _, err = train_in_process(run_dir, shakespeare)
    assert code == 2 and len(err.strip().splitlines()) == 1, err[-3000:]
    assert last_line(err) == f"error: cannot write to {target}: Read-only file system"
    assert time.time() - started < 60
    assert checkpoint_steps(run_dir) == [2, 4]


@contextlib.contextmanager
def mounted(path, *options):
    """`mount OPTIONS path` for the duration (a small tmpfs is a real full disk; needs root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting needs root")
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", *options, str(path)], check=True)
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)]).returncode:  # still in use: something left a file open
            subprocess.run(["umount", "--lazy", str(path)], check=True)
            raise AssertionError(f"{path} was still in use after the run")


@pytest.mark.parametrize("what", ["metrics.jsonl", "loss.png"])
def test_a_full_disk_at_the_metrics_or_the_plot_is_one_line(tmp_path, shakespeare, what):
    """The run directory on a 24 KB tmpfs (a 4 KB page each for config.json, .lock.json, metrics.jsonl and
    events.jsonl, and two spare), its checkpoints/ on a roomy disk: the logs fill the disk after some steps; the
    first loss.png (~30 KB) does not fit at all."""
    run_dir, roomy = tmp_path / "run", tmp_path / "roomy"
    roomy.mkdir()
    extra = ["--train.steps=60", "--train.eval_every=0"] if what == "metrics.jsonl" else ["--train.eval_every=4"]
    with mounted(run_dir, "-t", "tmpfs", "-o", "size=24k", "tmpfs"):
        with mounted(run_dir / "checkpoints", "--bind", str(roomy)):
            code, _, err = train_in_process(run_dir, shakespeare, *extra, "--log.wandb=disabled")
            steps = checkpoint_steps(run_dir)
    assert code == 2 and len(err.strip().splitlines()) == 1, err[-3000:]
    # the run directory's two append-only logs share the disk: whichever writes next meets it full
    failing = [what] if what == "loss.png" else ["metrics.jsonl", "events.jsonl"]
    assert last_line(err) in [f"error: cannot write {run_dir / name}: No space left on device" for name in failing]
    shutil.copytree(roomy, tmp_path / "copy" / "checkpoints")  # the checkpoints written before it are whole
    code, _, err = run_main(eval_app.main, "--run_dir", str(tmp_path / "copy"), "--step", str(steps[-1]),
                            "--batches", "1", "--no-wandb")
    assert code == 0, err[-2000:]


def test_a_full_disk_at_eval_json_is_one_line(tmp_path, reference):
    out_dir = tmp_path / "full"
    with mounted(out_dir, "-t", "tmpfs", "-o", "size=4k", "tmpfs"):
        (out_dir / "filler").write_bytes(b"x" * 4096)
        code, _, err = run_main(eval_app.main, "--run_dir", str(reference), "--batches", "1", "--no-wandb",
                                "--out", str(out_dir / "eval.json"))
    assert code == 2 and len(err.strip().splitlines()) == 1, err[-3000:]
    assert last_line(err) == f"error: cannot write {out_dir / 'eval.json'}: No space left on device"


def test_file_size_limit_at_config_json_is_one_line(tmp_path, shakespeare):
    """A full disk at the first write (config.json, ~1.6 KB) via a real size limit on a subprocess."""
    run_dir = tmp_path / "run"
    r = subprocess.run(["prlimit", "--fsize=1000", sys.executable, "train.py", *args(run_dir, shakespeare)],
                       cwd=ROOT, env=cli_env(1, NO_CACHE), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-3000:]
    assert last_line(r.stderr) == f"error: cannot write {run_dir / 'config.json'}: File too large"


def test_an_unwritable_run_directory_is_one_line(tmp_path, shakespeare):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code, _, err = train_in_process(blocker / "run", shakespeare)
    assert code == 2
    assert last_line(err).startswith(f"error: cannot create the run directory {blocker / 'run'}")


# ---- device count changes -------------------------------------------------------------------------


@pytest.mark.parametrize("devices", [2, 1])
def test_resume_on_another_device_count(tmp_path, shakespeare, reference, devices):
    """A checkpoint written on 8 devices resumes on 2 or 1; one written on 2 resumes on 8."""
    run_dir = rewound(reference, tmp_path, 6)  # written on 8 devices
    r = run_cli("train.py", *args(run_dir, shakespeare), devices=devices)
    assert r.returncode == 0, r.stderr[-3000:]
    np.testing.assert_allclose(step_losses(run_dir), step_losses(reference), rtol=0, atol=1e-5)
    if devices == 2:  # and back: its checkpoint 10, written on 2 devices, resumed on 8 (in this process)
        back = rewound(run_dir, tmp_path / "back", 10)
        code, out, err = train_in_process(back, shakespeare)
        assert code == 0, err[-3000:]
        assert f"resumed from {back / 'checkpoints' / '10'}" in out, out[-3000:]
        np.testing.assert_allclose(step_losses(back), step_losses(reference), rtol=0, atol=1e-5)


def test_bad_input_leaves_existing_run_data_untouched(tmp_path, shakespeare, reference):
    run_dir = rewound(reference, tmp_path, 4)
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    for bad in (["--model.n_head=3"], ["--train.batch_size=7"], ["--mesh.rules=nope"], ["--model.n_embd=64"]):
        code, _, err = train_in_process(run_dir, shakespeare, *bad)
        assert code == 2 and last_line(err).startswith("error: ")
    after = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    assert after == before
