"""The real train.py and eval.py: end-to-end runs in subprocesses (slow tier), and every check that ends a
run before any JAX work called in-process (`run_main`), with the flag names of the program the user ran."""

import json
import os
import shutil

import numpy as np
import pytest

import eval as eval_app
import train as train_app
from conftest import ROOT, SMALL, checkpoint_steps, last_line, read_jsonl, read_only, run_cli, run_main, step_losses


def train_args(run_dir, shakespeare, *extra):
    return ["--run_dir", str(run_dir), f"--data.cache_dir={shakespeare}", *SMALL, "--train.steps=12",
            "--checkpoint.every=4", "--checkpoint.keep=5", "--train.eval_every=4", *extra]


FSDP_TP = ["--train.steps_per_call=4", "--mesh.data=2", "--mesh.fsdp=2", "--mesh.tensor=2", "--mesh.rules=fsdp_tp"]


@pytest.fixture(scope="module")
def k4_run(tmp_path_factory, shakespeare):
    """12 steps, K=4, on 8 devices with a 2×2×2 fsdp_tp mesh, wandb offline, the end-of-run sample on."""
    run_dir = tmp_path_factory.mktemp("k4")
    r = run_cli("train.py", *train_args(run_dir, shakespeare, *FSDP_TP, "--log.wandb=offline",
                                        "--train.sample_tokens=8", "--log.param_report"))
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir, r


@pytest.fixture(scope="module")
def k1_run(tmp_path_factory, shakespeare):
    """The same 12 steps one per call, on a single device."""
    run_dir = tmp_path_factory.mktemp("k1")
    r = run_cli("train.py", *train_args(run_dir, shakespeare, "--train.steps_per_call=1"), devices=1)
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir, r


# ---- end-to-end runs --------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_run_leaves_metrics_checkpoints_plot_config_and_sample(k4_run):
    run_dir, result = k4_run
    records = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert set(steps[0]) == {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu", "peak_flops",
                             "skipped"}
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
    assert f"outputs: checkpoints {run_dir / 'checkpoints'}/{{4,8,12}}, metrics {run_dir / 'metrics.jsonl'}" in result.stdout


@pytest.mark.slow
def test_cli_losses_fall(k4_run):
    val = [r["val_loss"] for r in read_jsonl(k4_run[0] / "metrics.jsonl") if "val_loss" in r]
    assert val[0] > val[1] > val[2]


def wandb_records(path):
    """The protobuf records of a .wandb file (wandb's LevelDB-style log: 32 KiB blocks, 7-byte headers)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_finished_run_rerun_changes_nothing_and_extending_it_is_recorded(k4_run, shakespeare, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(k4_run[0], run_dir)
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    run = ["--run_dir", str(run_dir), f"--data.cache_dir={shakespeare}", *SMALL, "--checkpoint.every=4",
           "--checkpoint.keep=5", "--train.eval_every=4", *FSDP_TP[:1], "--log.wandb=offline"]
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


@pytest.mark.slow
def test_the_hint_to_extend_a_finished_run_works_as_printed(shakespeare, tmp_path):
    """With optim.decay_steps unset the cosine ends at train.steps: the hint fixes it there, and the extension
    trains on at the final learning rate."""
    run = ["--run_dir", str(tmp_path), f"--data.cache_dir={shakespeare}",
           *[a for a in SMALL if not a.startswith("--optim.decay_steps")], "--train.eval_every=0"]
    assert run_main(train_app.main, *run, "--train.steps=4")[0] == 0
    code, out, err = run_main(train_app.main, *run, "--train.steps=4")
    hint = out.strip().split("To continue it: ", 1)[1].split(" (")[0]
    assert code == 0 and hint == "--train.steps=MORE --optim.decay_steps=4", out
    code, out, err = run_main(train_app.main, *run, *hint.replace("MORE", "6").split())
    assert code == 0, err[-2000:]
    rates = [r["lr"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    assert len(rates) == 6 and rates[4] == rates[5] == pytest.approx(2e-3 * 0.1)  # shakespeare_cpu: lr · min_lr_ratio


@pytest.mark.slow
def test_cli_k4_on_8_devices_equals_k1_on_1_device(k4_run, k1_run):
    np.testing.assert_allclose(step_losses(k4_run[0]), step_losses(k1_run[0]), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_cli_exact_resume_is_bitwise(k4_run, shakespeare, tmp_path):
    first = run_cli("train.py", *train_args(tmp_path, shakespeare, *FSDP_TP, "--train.stop_after=4"))
    assert first.returncode == 0, first.stderr[-3000:]
    assert len(step_losses(tmp_path)) == 4
    second = run_cli("train.py", *train_args(tmp_path, shakespeare, *FSDP_TP))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout
    assert step_losses(tmp_path) == step_losses(k4_run[0])  # bitwise: same floats, same order


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_cli_eval_all_checkpoints_compiles_once_and_samples(k4_run, tmp_path, monkeypatch):
    """In-process, to see the executable: `--all` reuses one compiled loss call for every checkpoint."""
    from trainer.program import evaluator as evaluation

    built = []
    build = evaluation.Evaluator.build
    monkeypatch.setattr(evaluation.Evaluator, "build", classmethod(lambda cls, *a: built.append(build(*a)) or built[-1]))
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


@pytest.mark.slow
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


# ---- errors before any work, in-process ------------------------------------------------------------


def train_error(tmp_path, shakespeare, *args):
    code, _, stderr = run_main(train_app.main, "--run_dir", str(tmp_path / "run"), f"--data.cache_dir={shakespeare}",
                               *SMALL, *args)
    assert code == 2, stderr[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert len(stderr.strip().splitlines()) == 1, stderr[-2000:]
    assert stderr.lower().count("error") == 1, stderr  # one `error:` prefix, no library's wrapper around it
    return last_line(stderr)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model.n_layr=2"], "unknown config key --model.n_layr (did you mean model.n_layer?); valid keys"),
        (["--train.batch_size=many"], "--train.batch_size"),
        (["--model.dtype=float8"], "float8"),
        (["--model.n_head=3"], "model.n_head=3 must divide model.n_embd=32"),
        (["--train.steps=0"], "train.steps must be an integer >= 1, got 0"),
        (["--train.seq_len=128"], "error: train.seq_len=128 exceeds model.block_size=64: lower --train.seq_len, or"
                                  " raise --model.block_size (a fresh run only)"),
        (["--mesh.data=3"], "mesh data×fsdp×tensor = 3×1×1 = 3 but there are 8 devices"),
        (["--mesh.rules=zero3"], "--mesh.rules must be one of dp, fsdp, tp, fsdp_tp, got 'zero3'"),
        (["--train.batch_size=6"], "not divisible by the data-parallel size mesh.data×mesh.fsdp = 8"),
        (["--data.dataset=/nonexistent"], "/nonexistent: no such corpus directory; prepare one there: python -m"
                                          " data.prepare --source YOUR_FILES --out_dir /nonexistent (docs/data.md)"),
        ([f"--data.dataset={ROOT}/data/assets/shakespeare.jsonl.xz"],
         f"{ROOT}/data/assets/shakespeare.jsonl.xz is a file, not a prepared corpus directory; tokenize it first:"
         f" python -m data.prepare --source {ROOT}/data/assets/shakespeare.jsonl.xz --out_dir DIR, then pass DIR"),
        (["--optim.grad_clip=nan"], "optim.grad_clip must be a finite number >= 0, got nan"),
        (["--optim.lr=inf"], "optim.lr must be a finite number > 0, got inf"),
        (["--optim.lr=nan"], "optim.lr must be a finite number > 0, got nan"),
        (["--train.stop_after=-5"], "train.stop_after must be an integer >= 1, got -5"),
        (["--checkpoint.keep_every=0"], "checkpoint.keep_every must be an integer >= 1, got 0"),
        (["--optim.b2=1"], "optim.b2 must be a finite number in [0, 1), got 1"),
        (["--model.dropout=nan"], "--model.dropout must be a finite number in [0, 1), got nan"),
        (["--train.eval_every=-1"], "train.eval_every must be an integer >= 0, got -1"),
        (["--train.peak_flops=0"], "train.peak_flops must be a finite number > 0"),
        (["--train.sample_tokens=8", "--train.sample_prompt=" + " ".join(["word"] * 70)],
         "train.sample_prompt encodes to 70 tokens, more than model.block_size=64; shorten it"),
        (["--model.dtype=float16"], "model.dtype=float16 is not supported on cpu; use one of ['float32', 'bfloat16']"),
        (["--model.param_dtype=float16"], "model.param_dtype=float16 cannot be trained: the optimizer state is"),
        (["--log.progress=maybe"], "--log.progress takes true or false (1/0, yes/no), got 'maybe'"),
        (["--train.reschedule", "perhaps"], "--train.reschedule takes true or false (1/0, yes/no), got 'perhaps'"),
    ],
)
def test_train_config_errors_are_one_line_before_any_work(tmp_path, shakespeare, args, message):
    assert message in train_error(tmp_path, shakespeare, *args)
    assert not (tmp_path / "run").exists()


def test_a_validation_split_shorter_than_the_window_is_refused_naming_the_flags(tmp_path, shakespeare, capsys):
    """nanoGPT's workflow: one input.txt prepared at the default --val_fraction (a warning then, not a refusal);
    training refuses a window the split cannot fill, and trains with one it can."""
    from data.prepare import main as prepare_main

    text = tmp_path / "input.txt"
    text.write_text("ROMEO: But, soft! what light through yonder window breaks?\n" * 400)
    prepare_main(["--source", str(text), "--out_dir", str(tmp_path / "tiny"), "--val_fraction", "0.007"])
    warning = capsys.readouterr().err
    val_tokens = json.loads((tmp_path / "tiny" / "meta.json").read_text())["val_tokens"]
    assert 33 < val_tokens < 64
    assert warning.startswith(f"warning: {tmp_path / 'tiny'}: the val split has {val_tokens} tokens: windows of up"
                              f" to train.seq_len={val_tokens - 1} (GPT-2's is 1024); for longer ones raise"
                              " --val_fraction")
    message = train_error(tmp_path, shakespeare, f"--data.dataset={tmp_path / 'tiny'}", "--train.seq_len=64")
    assert message == (f"error: {tmp_path / 'tiny'}: the val split has {val_tokens} tokens, fewer than one window of"
                       f" seq_len + 1 = 65; lower train.seq_len (eval.py: --seq_len) below {val_tokens}, or prepare the"
                       " corpus again with a larger --val_fraction")


def _corpus_copy(shakespeare, tmp_path, damage):
    d = tmp_path / "corpus"
    shutil.copytree(shakespeare, d)
    damage(d)
    return d


def _meta_edit(d, **changes):
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps({**meta, **changes}))


def _odd_bytes(d):
    with open(d / "train.bin", "ab") as f:
        f.write(b"\x00")


def _truncated(d):
    tokens = np.fromfile(d / "train.bin", dtype="<u2")[:500_000]
    tokens.tofile(d / "train.bin")


def _big_ids(d):
    (d / "train.bin").write_bytes(np.full(10_000, 65_000, dtype="<u2").tobytes())
    _meta_edit(d, train_tokens=10_000, max_token_id=65_000)


@pytest.mark.parametrize(
    "damage, message",
    [
        (_odd_bytes, "bytes is not a whole number of uint16 tokens"),
        (_truncated, "train.bin hold 500,000 tokens but meta.json says"),
        (_big_ids, "meta.json: holds token id 65000, >= the model's vocabulary of 50257"),
        (lambda d: _meta_edit(d, tokenizer="cl100k_base", tokenizer_sha256="0" * 64), "tokenized with 'cl100k_base'"),
        (lambda d: (d / "meta.json").write_text("{"), "meta.json: not a meta.json written by data.prepare"),
        (lambda d: (d / "meta.json").unlink(), "meta.json: missing"),
    ],
)
def test_a_bad_corpus_is_one_line_before_any_work(tmp_path, shakespeare, damage, message):
    corpus = _corpus_copy(shakespeare, tmp_path, damage)
    assert message in train_error(tmp_path, shakespeare, f"--data.dataset={corpus}")


@pytest.mark.slow
def test_an_id_beyond_the_vocabulary_found_mid_run_stops_cleanly(tmp_path, shakespeare):
    """A corpus without max_token_id in its meta.json (made by hand) is also checked as it is read. Here its
    train.bin is overwritten with bad ids while the run reads it: one line, and the checkpoints saved before
    stay whole."""
    import subprocess
    import sys
    import time

    from conftest import cli_env

    def no_max_id(d):
        meta = json.loads((d / "meta.json").read_text())
        meta.pop("max_token_id", None)
        (d / "meta.json").write_text(json.dumps(meta))

    corpus = _corpus_copy(shakespeare, tmp_path, no_max_id)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "train.py", "--run_dir", str(run_dir), f"--data.dataset={corpus}",
                             *SMALL, "--train.steps=100000", "--checkpoint.every=2"],
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


def eval_error(*args):
    code, _, stderr = run_main(eval_app.main, *args)
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr[-2000:]
    return last_line(stderr)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max_new_tokens", "0"], "--max_new_tokens must be an integer >= 1, got 0"),
        (["--max_new_tokens", "-3"], "--max_new_tokens must be an integer >= 1, got -3"),
        (["--top_k", "0"], "--top_k must be an integer >= 1, got 0"),
        (["--batches", "0"], "--batches must be an integer >= 1, got 0"),
        (["--batch_size", "0"], "--batch_size must be an integer >= 1, got 0"),
        (["--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),
        (["--step", "4", "--all"], "give --step or --all, not both"),
        (["--mesh.rules", "zero3"], "--mesh.rules must be one of dp, fsdp, tp, fsdp_tp, got 'zero3'"),
    ],
)
def test_eval_arguments_are_checked_before_any_work(tmp_path, args, message):
    assert message in eval_error("--run_dir", str(tmp_path), *args)


def test_a_bad_boolean_value_names_its_flag_in_every_program():
    from data import prepare

    assert eval_error("--all=maybe") == ("error: --all takes true or false (1/0, yes/no), got 'maybe'; or the switches"
                                         " --all / --no_all")
    code, _, err = run_main(prepare.main, "--source", "x", "--out_dir", "y", "--overwrite=perhaps")
    assert code == 2 and err.strip() == ("error: --overwrite takes true or false (1/0, yes/no), got 'perhaps'; or the"
                                         " switches --overwrite / --no_overwrite")


@pytest.fixture
def k4_copy(k4_run, tmp_path):
    """A copy of the k4 run to damage."""
    run_dir = tmp_path / "run"
    shutil.copytree(k4_run[0], run_dir)
    return run_dir


def eval_lines(*args):
    code, out, err = run_main(eval_app.main, "--batches", "1", "--no-wandb", *args)
    return code, out, err.strip().splitlines()


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("content", ['{"12": {"val_loss": 5.0}}', '{"resu'])
def test_a_foreign_or_corrupt_eval_json_is_refused_before_the_evaluation(k4_copy, content):
    (k4_copy / "eval.json").write_text(content)
    code, out, err = eval_lines("--run_dir", str(k4_copy))
    assert code == 2 and out == "" and err == [f"error: {k4_copy / 'eval.json'}: not an eval.json written by eval.py;"
                                               " move it away or pass another --out"]
    assert (k4_copy / "eval.json").read_text() == content


@pytest.mark.slow
def test_eval_of_a_read_only_run_dir_asks_for_out_first_then_evaluates(k4_copy, tmp_path):
    """A mounted bucket, say: eval.json cannot go there (said before any work), the library logs go elsewhere."""
    with read_only(k4_copy):
        code, out, err = eval_lines("--run_dir", str(k4_copy))
        assert code == 2 and out == "" and err == [f"error: cannot write {k4_copy / 'eval.json'}: Read-only file"
                                                   " system; pass --out to write the results elsewhere"]
        code, out, err = eval_lines("--run_dir", str(k4_copy), "--out", str(tmp_path / "results.json"))
    assert code == 0, err
    assert "step 12: val_loss" in out and (tmp_path / "results.json").exists()
    assert len(err) == 1 and err[0].startswith(f"warning: cannot write library logs to {k4_copy / 'logs'}/process_0"
                                               ".log (Read-only file system); they are in ")


def test_eval_needs_a_run_or_weights_and_says_which_is_missing(tmp_path):
    assert eval_error("--run_dir", str(tmp_path)) == f"error: {tmp_path / 'checkpoints'}: no checkpoints to evaluate"
    assert "give exactly one of --run_dir" in eval_error()
    assert "--hf needs --dataset" in eval_error("--hf", str(tmp_path))


def test_hf_paths_are_unambiguous(tmp_path, shakespeare, monkeypatch):
    """`gpt2` from the repository root is the package directory, not the hub model: the hub is `hub:gpt2`."""
    monkeypatch.chdir(ROOT)
    args = ["--dataset", str(shakespeare), "--out", str(tmp_path / "r.json")]
    assert "gpt2: a directory without config.json; give a Hugging Face checkpoint directory, or hub:gpt2" in \
        eval_error("--hf", "gpt2", *args)
    bad = tmp_path / "hf"
    bad.mkdir()
    (bad / "config.json").write_text("not json")
    assert f"{bad / 'config.json'}: not a readable Hugging Face config.json" in eval_error("--hf", str(bad), *args)


@pytest.mark.slow
def test_a_truncated_safetensors_file_is_one_line_naming_it(tmp_path, shakespeare):
    transformers = pytest.importorskip("transformers")
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=64, n_embd=32, n_layer=2, n_head=2)
                                 ).save_pretrained(tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    message = eval_error("--hf", str(tmp_path / "hf"), "--dataset", str(shakespeare), "--out", str(tmp_path / "r.json"))
    assert f"{weights}: not a readable safetensors file" in message


@pytest.mark.slow
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

    assert "checkpoint does not fit this model: model.n_layer: checkpoint 2 vs config 3" in refused("--model.n_layer=3")
    assert "checkpoint was trained with train.seq_len=32, this run has 16" in refused("--train.seq_len=16")
    other = _corpus_copy(shakespeare, tmp_path, _truncated)
    _meta_edit(other, train_tokens=500_000)
    assert "checkpoint was trained on another corpus" in refused(f"--data.dataset={other}")
    message = refused("--optim.decay_steps=2000")
    assert "resuming would change the learning-rate schedule (optim.decay_steps" in message
    assert "1000 -> 2000" in message and "--train.reschedule=True" in message
    assert "(optim.lr: 0.002 -> 0.001); keep the old values, or pass --train.reschedule=True" in refused("--optim.lr=1e-3")
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"} == \
        {p: t for p, t in before.items() if p.name != ".lock"}


# ---- the command line as documented -------------------------------------------------------------


@pytest.mark.parametrize("program", [train_app.main, eval_app.main, "prepare", "plan"])
def test_help_documents_every_flag(program, monkeypatch):
    """Every field's flag carries a description (and train.py's and plan.py's --help list the presets)."""
    import re

    import plan
    from data import prepare

    monkeypatch.setenv("COLUMNS", "80")  # one panel wide: each flag's line, then its description's
    main = {"prepare": prepare.main, "plan": plan.main}.get(program, program)
    code, out, _ = run_main(main, "--help")
    assert code == 0
    lines = [re.sub(r"^[│\s]+|[│\s]+$", "", line) for line in out.splitlines()]
    flags = [i for i, line in enumerate(lines)
             if re.match(r"--[a-z][\w.-]*(,| |$)", line) and not line.startswith("--config")]
    assert len(flags) > 10
    for i in flags:  # a description beside the flag, or under it (where a field without one shows its default)
        beside = re.split(r"\s{2,}", lines[i], maxsplit=1)[1:]
        text = beside[0] if beside else lines[i + 1]
        assert text and not re.match(r"\(default|\(required|--\w", text), lines[i]
    if program in (train_app.main, "plan"):
        assert "--config NAME" in out and "gpt2_124m, gpt2_medium, gpt2_xl_pod, shakespeare_cpu" in out
    if program == "plan":
        assert "--topology" in out and "--search" in out and "--train.batch_size" in out


@pytest.mark.parametrize("form", [["--log.progress=false"], ["--log.progress", "False"], ["--log.no_progress"],
                                  ["--log.no-progress"], ["--log.progress=0"]])
def test_one_boolean_style_with_every_documented_form(form):
    """Booleans are tyro's switches in all three programs, and the value forms work as well."""
    import configs
    from configs.base import Config
    from configs.cli import parse
    from data.prepare import PrepareConfig

    cfg = parse(Config, [*form, "--train.reschedule"], default=configs.load("shakespeare_cpu"), prog="train.py")
    assert cfg.log.progress is False and cfg.train.reschedule is True
    for args in (["--overwrite"], ["--overwrite=true"], ["--overwrite", "yes"]):
        assert parse(PrepareConfig, ["--source", "x", "--out_dir", "y", *args], prog="prepare").overwrite is True
    assert parse(PrepareConfig, ["--source", "x", "--out_dir", "y", "--no-overwrite"], prog="prepare").overwrite is False
    assert parse(eval_app.EvalConfig, ["--run_dir=r", "--all=True", "--no-wandb"], prog="eval.py").all is True


@pytest.mark.slow
def test_a_profile_is_one_flag_away_and_changes_no_number(k1_run, shakespeare, tmp_path):
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
