"""The real train.py and eval.py run end to end, in subprocesses and in-process: metrics, checkpoints, wandb
offline, exact resume, extending a finished run, K-step calls on 8 devices against 1, evaluation on other meshes,
profiles. The checks before any work: tests/unit."""

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

import eval as eval_app
import train as train_app
from support.cli import (ROOT, SMALL, checkpoint_steps, eval_error, read_jsonl, read_only, rewound, run_cli, run_main,
                         step_losses, wandb_records)
from support.corpora import damaged_copy, edit_meta, truncate_train_bin


def train_args(run_dir, shakespeare, *extra):
    return ["--run_dir", str(run_dir), f"--data.cache_dir={shakespeare}", *SMALL, "--train.steps=12",
            "--checkpoint.every=4", "--checkpoint.keep=5", "--train.eval_every=4", *extra]


FSDP_TP = ["--train.steps_per_call=4", "--mesh.data=2", "--mesh.fsdp=2", "--mesh.tensor=2", "--mesh.rules=fsdp_tp"]
K4 = [*FSDP_TP, "--log.wandb=offline", "--train.sample_tokens=8", "--log.param_report"]  # k4_run's flags


@pytest.fixture(scope="module")
def k4_run(tmp_path_factory, shakespeare):
    """12 steps, K=4, on 8 devices with a 2×2×2 fsdp_tp mesh, wandb offline, the end-of-run sample on."""
    run_dir = tmp_path_factory.mktemp("k4")
    r = run_cli("train.py", *train_args(run_dir, shakespeare, *K4))
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir, r


@pytest.fixture(scope="module")
def k1_run(tmp_path_factory, shakespeare):
    """The same 12 steps one per call, on a single device."""
    run_dir = tmp_path_factory.mktemp("k1")
    r = run_cli("train.py", *train_args(run_dir, shakespeare, "--train.steps_per_call=1"), devices=1)
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir, r


def test_cli_run_leaves_metrics_checkpoints_plot_config_and_sample(k4_run):
    run_dir, result = k4_run
    records = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert set(steps[0]) == {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu", "peak_flops",
                             "skipped", "streak"}  # what the step reports (the optimizer's lr, the guard's), then speed
    assert len({r["peak_flops"] for r in steps}) == 1  # one peak for the whole run: MFUs compare
    # the first call (4 steps) compiled and first loaded the program: its speed is unknown, not a wrong number
    assert [r["mfu"] is None for r in steps] == [True] * 4 + [False] * 8
    assert all(r["tokens_per_s"] > 0 for r in steps[4:])
    assert steps[-1]["tokens"] == 12 * 8 * 32
    assert [r["step"] for r in records if "val_loss" in r] == [4, 8, 12]
    assert checkpoint_steps(run_dir) == [4, 8, 12]
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((run_dir / "config.json").read_text())["mesh"]["rules"] == "fsdp_tp"
    assert "--- sample ---\nROMEO:" in result.stdout
    assert "wte.embedding" in result.stdout  # the parameter report (--log.param_report)
    # a start-up summary of a few lines, and where every output went
    assert result.stdout.startswith(f"run      {run_dir} (new; config.json)\nmodel    ")
    outputs = f"outputs: checkpoints {run_dir / 'checkpoints'}/{{4,8,12}}, metrics {run_dir / 'metrics.jsonl'}"
    assert outputs in result.stdout


def test_cli_losses_fall(k4_run):
    val = [r["val_loss"] for r in read_jsonl(k4_run[0] / "metrics.jsonl") if "val_loss" in r]
    assert val[0] > val[1] > val[2]


def test_cli_wandb_offline_run_holds_the_logged_metrics(k4_run):
    run_dir, _ = k4_run
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    history = list(runs[0].glob("run-*.wandb"))
    assert history and history[0].stat().st_size > 0
    logged = [{item.key or ".".join(item.nested_key): item.value_json for item in rec.history.item}
              for rec in wandb_records(history[0]) if rec.WhichOneof("record_type") == "history"]
    losses = [json.loads(h["loss"]) for h in logged if "loss" in h]
    assert losses == pytest.approx(step_losses(run_dir), abs=1e-6)
    assert [json.loads(h["val_loss"]) for h in logged if "val_loss" in h] == pytest.approx(
        [r["val_loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "val_loss" in r])


def test_cli_eval_of_an_offline_run_stays_offline_with_credentials_set(k4_run, tmp_path):
    """The wandb mode is decided once, at training, and recorded: with an API key in the environment, eval.py
    still logs the offline run offline (it would otherwise go online, here: fail without a network)."""
    run_dir = tmp_path / "run"
    shutil.copytree(k4_run[0], run_dir)
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"}
    r = run_cli("eval.py", "--run_dir", str(run_dir), "--batches", "1", devices=1,
                env={**env, "WANDB_API_KEY": "x" * 40, "WANDB_BASE_URL": "http://127.0.0.1:9"})
    assert r.returncode == 0, r.stderr[-3000:]
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and not list((run_dir / "wandb").glob("run-*"))


def test_a_finished_run_rerun_changes_nothing_and_extending_it_is_recorded(k4_run, shakespeare, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(k4_run[0], run_dir)
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    run = ["--run_dir", str(run_dir), f"--data.cache_dir={shakespeare}", *SMALL, "--checkpoint.every=4",
           "--checkpoint.keep=5", "--train.eval_every=4", *FSDP_TP, "--log.wandb=offline"]  # k4_run's mesh and K
    code, out, err = run_main(train_app.main, *run, "--train.steps=12")
    assert code == 0, err
    assert out.strip() == f"{run_dir}: already finished at step 12; train.steps=12. To continue it:" \
                          " --train.steps=MORE (docs/training.md)"
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()} == before  # no config, no wandb run
    config = (run_dir / "config.json").read_text()
    code, out, err = run_main(train_app.main, *run, "--train.steps=14")  # same schedule: decay_steps is fixed
    assert code == 0, err[-2000:]
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r] == list(range(1, 15))
    assert (run_dir / "config.json").read_text() == config  # the first start's config is never overwritten
    (change,) = read_jsonl(run_dir / "config_changes.jsonl")
    assert change["step"] == 12 and change["changes"]["train.steps"] == [12, 14]


def test_the_hint_to_extend_a_finished_run_works_as_printed(shakespeare, tmp_path):
    """With schedule.decay_steps unset the cosine ends at train.steps: the hint fixes it there, and the extension
    trains on at the final learning rate."""
    run = ["--run_dir", str(tmp_path), f"--data.cache_dir={shakespeare}",
           *[a for a in SMALL if not a.startswith("--schedule.decay_steps")], "--train.eval_every=0"]
    assert run_main(train_app.main, *run, "--train.steps=4")[0] == 0
    code, out, err = run_main(train_app.main, *run, "--train.steps=4")
    hint = out.strip().split("To continue it: ", 1)[1].split(" (")[0]
    assert code == 0 and hint == "--train.steps=MORE --schedule.decay_steps=4", out
    code, out, err = run_main(train_app.main, *run, *hint.replace("MORE", "6").split())
    assert code == 0, err[-2000:]
    rates = [r["lr"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    assert len(rates) == 6 and rates[4] == rates[5] == pytest.approx(2e-3 * 0.1)  # shakespeare_cpu: lr · min_lr_ratio


def test_cli_k4_on_8_devices_equals_k1_on_1_device(k4_run, k1_run):
    np.testing.assert_allclose(step_losses(k4_run[0]), step_losses(k1_run[0]), rtol=0, atol=1e-5)


def test_cli_exact_resume_is_bitwise(k4_run, shakespeare, tmp_path):
    run_dir = rewound(k4_run[0], tmp_path, 4)  # k4_run rewound to its checkpoint 4
    r = run_cli("train.py", *train_args(run_dir, shakespeare, *K4))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / '4'}" in r.stdout
    assert step_losses(run_dir) == step_losses(k4_run[0])  # bitwise: same floats, same order


def test_cli_resume_with_another_k_keeps_the_data_position(k1_run, shakespeare, tmp_path):
    """Steps 1-4 at K=1, then 5-12 at K=4: the same rows in the same order, so the same losses."""
    run_dir = tmp_path / "run"
    shutil.copytree(k1_run[0], run_dir)
    for step in ("8", "12"):
        shutil.rmtree(run_dir / "checkpoints" / step)
    r = run_cli("train.py", *train_args(run_dir, shakespeare, "--train.steps_per_call=4"), devices=1)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout
    np.testing.assert_allclose(step_losses(run_dir), step_losses(k1_run[0]), rtol=0, atol=1e-5)


def test_cli_steps_are_exact_when_k_does_not_divide_them(k1_run, shakespeare, tmp_path):
    """steps=10 with K=4, eval every 3, checkpoint every 4: exactly 10 steps, evaluations at 3, 6, 9 and
    the last step, checkpoints at 4, 8 and 10 — the losses of the K=1 run's first 10 steps."""
    r = run_cli("train.py", *train_args(tmp_path, shakespeare, "--train.steps=10", "--train.steps_per_call=4",
                                        "--train.eval_every=3"), devices=1)
    assert r.returncode == 0, r.stderr[-3000:]
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [x["step"] for x in records if "loss" in x] == list(range(1, 11))
    assert [x["step"] for x in records if "val_loss" in x] == [3, 6, 9, 10]
    assert checkpoint_steps(tmp_path) == [4, 8, 10]
    np.testing.assert_allclose(step_losses(tmp_path), step_losses(k1_run[0])[:10], rtol=0, atol=1e-5)
    # eval_every=0: only the final evaluation, still at the last step; and stop_after within a call
    code, _, err = run_main(train_app.main, *train_args(tmp_path / "b", shakespeare, "--train.steps=7",
                                                        "--train.steps_per_call=4", "--train.eval_every=0"))
    assert code == 0, err[-2000:]
    records = read_jsonl(tmp_path / "b" / "metrics.jsonl")
    assert [x["step"] for x in records if "loss" in x] == list(range(1, 8))
    assert [x["step"] for x in records if "val_loss" in x] == [7] and checkpoint_steps(tmp_path / "b") == [4, 7]


@pytest.mark.parametrize("source, devices", [("k4_run", 1), ("k1_run", 8)])
def test_cli_eval_on_other_device_counts_matches(request, source, devices):
    run_dir, _ = request.getfixturevalue(source)
    results = {}
    for n in (devices, 8 if devices == 1 else 1):
        out = run_dir / f"eval-{n}.json"
        r = run_cli("eval.py", "--run_dir", str(run_dir), "--batches", "4", "--out", str(out), "--no-wandb",
                    devices=n)
        assert r.returncode == 0, r.stderr[-3000:]
        (record,) = json.loads(out.read_text())["results"]
        assert record["step"] == 12 and record["batches_evaluated"] == 4
        results[n] = record["val_loss"]
    assert abs(results[1] - results[8]) <= 1e-5


def test_cli_eval_all_checkpoints_compiles_once_and_samples(k4_run, tmp_path, monkeypatch):
    """In-process, to see the executable: `--all` reuses one compiled loss call for every checkpoint."""
    from trainer.program import evaluator as evaluation

    built = []
    build = evaluation.Evaluator.build
    monkeypatch.setattr(evaluation.Evaluator, "build",
                        classmethod(lambda cls, *a: built.append(build(*a)) or built[-1]))
    out = tmp_path / "eval.json"
    code, stdout, stderr = run_main(eval_app.main, "--run_dir", str(k4_run[0]), "--all", "--batches", "2",
                                    "--prompt", "KING:", "--max_new_tokens", "5", "--temperature", "0",
                                    "--out", str(out), "--no-wandb")
    assert code == 0, stderr[-3000:]
    results = {r["step"]: r for r in json.loads(out.read_text())["results"]}
    assert sorted(results) == [4, 8, 12]
    assert results[4]["val_loss"] > results[12]["val_loss"]
    assert stdout.count("KING:") == 3
    assert len(built) == 1 and built[0].loss_call._cache_size() == 1


def test_cli_eval_of_hugging_face_weights(tmp_path, shakespeare):
    transformers = pytest.importorskip("transformers")
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=64, n_embd=32, n_layer=2, n_head=2)
                                 ).save_pretrained(tmp_path / "hf")
    out = tmp_path / "hf.json"
    code, stdout, stderr = run_main(eval_app.main, "--hf", str(tmp_path / "hf"), "--dataset", str(shakespeare),
                                    "--batches", "2", "--seq_len", "32", "--out", str(out), "--prompt", "KING:",
                                    "--max_new_tokens", "4")
    assert code == 0, stderr[-3000:]
    (result,) = json.loads(out.read_text())["results"]
    assert result["batches_evaluated"] == 2 and abs(result["val_loss"] - np.log(50257)) < 0.5  # random init
    assert "KING:" in stdout


def test_an_id_beyond_the_vocabulary_found_mid_run_stops_cleanly(tmp_path, shakespeare):
    """A corpus without max_token_id in its meta.json (made by hand) is also checked as it is read. Here its
    train.bin is overwritten with bad ids while the run reads it: one line, and the checkpoints saved before
    stay whole."""
    import subprocess
    import sys
    import time

    from support.cli import cli_env

    def no_max_id(d):
        meta = json.loads((d / "meta.json").read_text())
        meta.pop("max_token_id", None)
        (d / "meta.json").write_text(json.dumps(meta))

    corpus = damaged_copy(shakespeare, tmp_path, no_max_id)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "train.py", "--run_dir", str(run_dir), f"--data.dataset={corpus}",
                             *SMALL, "--train.steps=100000", "--checkpoint.every=2",
                             "--train.steps_per_call=4"],  # the one-device train call of the K=4 resume above
                            cwd=ROOT, env=cli_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not ((run_dir / "checkpoints").exists() and checkpoint_steps(run_dir)):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    size = (corpus / "train.bin").stat().st_size
    with open(corpus / "train.bin", "r+b") as f:  # in place: the loader's memory map sees the new bytes
        f.write(np.full(size // 2, 65_000, dtype="<u2").tobytes())
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2
    assert len(err.strip().splitlines()) == 1, err[-3000:]
    assert "token id 65000" in err and "is >= vocab size 50257" in err
    assert checkpoint_steps(run_dir) and not [p for p in (run_dir / "checkpoints").iterdir() if "tmp" in p.name]


@pytest.fixture
def k4_copy(k4_run, tmp_path):
    """A copy of the k4 run to damage."""
    run_dir = tmp_path / "run"
    shutil.copytree(k4_run[0], run_dir)
    return run_dir


def eval_lines(*args):
    code, out, err = run_main(eval_app.main, "--batches", "1", "--no-wandb", *args)
    return code, out, err.strip().splitlines()


def test_eval_of_a_damaged_latest_checkpoint_is_one_line_and_all_goes_past_it(k4_copy):
    for f in (k4_copy / "checkpoints" / "12" / "state").rglob("*"):
        if f.is_file() and "/d/" in str(f):
            f.unlink()
    code, _, err = eval_lines("--run_dir", str(k4_copy))
    assert code == 2 and len(err) == 1, err[:20]  # not Orbax's closed event loop, once per pending read
    assert err[0].startswith(f"error: {k4_copy / 'checkpoints' / '12'}: cannot be restored (NOT_FOUND")
    assert err[0].endswith("checkpoints in this run: [4, 8, 12]")
    code, out, err = eval_lines("--run_dir", str(k4_copy), "--all")
    assert code == 2 and len(err) == 2 and err[0].startswith("warning: "), err[:20]
    assert err[1] == "error: 1 of 3 checkpoints could not be evaluated (steps [12]); the others' results are saved"
    assert sorted(r["step"] for r in json.loads((k4_copy / "eval.json").read_text())["results"]) == [4, 8]


@pytest.mark.parametrize("content", ['{"12": {"val_loss": 5.0}}', '{"resu'])
def test_a_foreign_or_corrupt_eval_json_is_refused_before_the_evaluation(k4_copy, content):
    (k4_copy / "eval.json").write_text(content)
    code, out, err = eval_lines("--run_dir", str(k4_copy))
    assert code == 2 and out == "" and err == [f"error: {k4_copy / 'eval.json'}: not an eval.json written by eval.py;"
                                               " move it away or pass another --out"]
    assert (k4_copy / "eval.json").read_text() == content


def test_eval_of_a_read_only_run_dir_asks_for_out_first_then_evaluates(k4_copy, tmp_path, monkeypatch):
    """A mounted bucket, say: eval.json cannot go there (said before any work), the library logs go elsewhere:
    to the temporary directory, here the test's own."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with read_only(k4_copy):
        code, out, err = eval_lines("--run_dir", str(k4_copy))
        assert code == 2 and out == "" and err == [f"error: cannot write {k4_copy / 'eval.json'}: Read-only file"
                                                   " system; pass --out to write the results elsewhere"]
        code, out, err = eval_lines("--run_dir", str(k4_copy), "--out", str(tmp_path / "results.json"))
    assert code == 0, err
    assert "step 12: val_loss" in out and (tmp_path / "results.json").exists()
    assert len(err) == 1 and err[0].startswith(f"warning: cannot write library logs to {k4_copy / 'logs'}/process_0"
                                               ".log (Read-only file system); they are in ")
    elsewhere = Path(err[0].split("; they are in ")[1])
    assert elsewhere.parent == tmp_path and elsewhere.read_text()  # Orbax's notes on the read-only checkpoints


def test_a_truncated_safetensors_file_is_one_line_naming_it(tmp_path, shakespeare):
    transformers = pytest.importorskip("transformers")
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=64, n_embd=32, n_layer=2, n_head=2)
                                 ).save_pretrained(tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    message = eval_error("--hf", str(tmp_path / "hf"), "--dataset", str(shakespeare), "--out", str(tmp_path / "r.json"))
    assert f"{weights}: not a readable safetensors file" in message


def test_refusals_on_resume_name_the_fields(k4_run, shakespeare, tmp_path):
    """Another model shape, window length, corpus or learning-rate schedule: one line each, nothing written."""
    run_dir = tmp_path / "run"
    shutil.copytree(k4_run[0], run_dir)
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}

    def refused(*args):
        code, _, stderr = run_main(train_app.main, "--run_dir", str(run_dir), f"--data.cache_dir={shakespeare}",
                                   *SMALL, "--train.steps=16", "--checkpoint.every=4", *args)
        assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr[-2000:]
        return stderr

    message = refused("--model.n_layer=3")
    assert "checkpoint does not fit this model: model.n_layer: checkpoint 2 vs config 3" in message
    assert f"start this one in a fresh --run_dir (e.g. --run_dir={run_dir}_2)" in message
    assert "checkpoint was trained with train.seq_len=32, this run has 16" in refused("--train.seq_len=16")
    other = damaged_copy(shakespeare, tmp_path, truncate_train_bin)
    edit_meta(other, train_tokens=500_000)
    assert "checkpoint was trained on another corpus" in refused(f"--data.dataset={other}")
    message = refused("--schedule.decay_steps=2000")
    assert "resuming would change the optimizer or its schedule (schedule.decay_steps: 1000 -> 2000)" in message
    assert "1000 -> 2000" in message and "--train.reschedule=True" in message
    assert ("(optim.lr: 0.002 -> 0.001); keep the old values, or pass --train.reschedule=True"
            in refused("--optim.lr=1e-3"))
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"} == \
        {p: t for p, t in before.items() if p.name != ".lock"}


def test_a_profile_is_one_flag_away_and_changes_no_number(shakespeare, tmp_path):
    """`--log.profile_start` writes a jax.profiler trace into the run directory; training is bitwise the same."""
    code, out, err = run_main(train_app.main, *train_args(tmp_path, shakespeare, "--train.steps=8",
                                                          "--train.steps_per_call=1", "--log.profile_start=3",
                                                          "--log.profile_steps=2"))
    assert code == 0, err[-2000:]
    traces = list((tmp_path / "profile").rglob("*.xplane.pb"))
    assert traces and traces[0].stat().st_size > 0
    assert f"profile of steps 3-4: {tmp_path / 'profile'}" in out
    code, _, err = run_main(train_app.main, *train_args(tmp_path / "plain", shakespeare, "--train.steps=8",
                                                        "--train.steps_per_call=1"))
    assert code == 0, err[-2000:]
    assert step_losses(tmp_path) == step_losses(tmp_path / "plain")
