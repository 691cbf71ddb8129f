"""train.py, eval.py, plan.py and data.prepare called in-process (`run_main`): every check that ends a run before
any JAX work, with the flag names of the program the user ran; `--help` documents every flag. The runs: tests/e2e."""

import json

import numpy as np
import pytest

import eval as eval_app
import train as train_app
from support.cli import ROOT, SMALL, last_line, run_main
from support.corpora import damaged_copy, edit_meta, truncate_train_bin
from support.cli import eval_error


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
        (["--model.n_layr=2"], "unknown config key --model.n_layr (did you mean --model.n_layer?); valid keys"),
        (["--train.batch_size=many"], "--train.batch_size takes an integer, got 'many'"),
        (["--train.steps", "abc"], "--train.steps takes an integer, got 'abc'"),
        (["--optim.lr=fast"], "--optim.lr takes a number, got 'fast'"),
        (["--lr=1e-3"], "unknown config key --lr (did you mean --optim.lr?)"),  # across sections
        (["--steps=5"], "unknown config key --steps (did you mean --train.steps?)"),
        (["--optim.warmup_steps=5"], "unknown config key --optim.warmup_steps (did you mean --schedule.warmup_steps?)"),
        (["--optim.muon_lr=0.1"], "unknown config key --optim.muon_lr (a field of --optim.name=muon)"),
        (["--optim.name=lion"], "--optim.name must be one of adamw, muon, got 'lion'"),
        (["--schedule.name=wsd"], "unknown config key --schedule.decay_steps (a field of --schedule.name=cosine)"),
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
        ([f"--data.cache_dir={ROOT}/data/assets/shakespeare.jsonl.xz"],
         f"data.cache_dir={ROOT}/data/assets/shakespeare.jsonl.xz is a file; the embedded corpus is tokenized into a"
         " directory: pass a directory (it is made if missing), or a prepared corpus with --data.dataset=DIR"),
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
    from data.prepare.cli import main as prepare_main

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


def _odd_bytes(d):
    with open(d / "train.bin", "ab") as f:
        f.write(b"\x00")


def _big_ids(d):
    (d / "train.bin").write_bytes(np.full(10_000, 65_000, dtype="<u2").tobytes())
    edit_meta(d, train_tokens=10_000, max_token_id=65_000)


@pytest.mark.parametrize(
    "damage, message",
    [
        (_odd_bytes, "bytes is not a whole number of uint16 tokens"),
        (truncate_train_bin, "train.bin hold 500,000 tokens but meta.json says"),
        (_big_ids, "meta.json: holds token id 65000, >= the model's vocabulary of 50257"),
        (lambda d: edit_meta(d, tokenizer="cl100k_base", tokenizer_sha256="0" * 64), "tokenized with 'cl100k_base'"),
        (lambda d: (d / "meta.json").write_text("{"), "meta.json: not a meta.json written by data.prepare"),
        (lambda d: (d / "meta.json").unlink(), "meta.json: missing"),
    ],
)
def test_a_bad_corpus_is_one_line_before_any_work(tmp_path, shakespeare, damage, message):
    corpus = damaged_copy(shakespeare, tmp_path, damage)
    assert message in train_error(tmp_path, shakespeare, f"--data.dataset={corpus}")


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
    from data.prepare import cli as prepare

    assert eval_error("--all=maybe") == ("error: --all takes true or false (1/0, yes/no), got 'maybe'; or the switches"
                                         " --all / --no_all")
    code, _, err = run_main(prepare.main, "--source", "x", "--out_dir", "y", "--overwrite=perhaps")
    assert code == 2 and err.strip() == ("error: --overwrite takes true or false (1/0, yes/no), got 'perhaps'; or the"
                                         " switches --overwrite / --no_overwrite")


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


@pytest.mark.parametrize("program", [train_app.main, eval_app.main, "prepare", "plan"])
def test_help_documents_every_flag(program, monkeypatch):
    """Every field's flag carries a description (and train.py's and plan.py's --help list the presets)."""
    import re

    import plan
    from data.prepare import cli as prepare

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
        import configs

        assert "--config NAME" in out and all(name in out for name in configs.PRESETS)
    if program == "plan":
        assert "--topology" in out and "--search" in out and "--train.batch_size" in out


@pytest.mark.parametrize("form", [["--log.progress=false"], ["--log.progress", "False"], ["--log.no_progress"],
                                  ["--log.no-progress"], ["--log.progress=0"]])
def test_one_boolean_style_with_every_documented_form(form):
    """Booleans are tyro's switches in all three programs, and the value forms work as well."""
    import configs
    from configs.base import Config
    from configs.cli import parse
    from configs.eval import EvalConfig
    from data.prepare import PrepareConfig

    cfg = parse(Config, [*form, "--train.reschedule"], default=configs.load("shakespeare_cpu"), prog="train.py")
    assert cfg.log.progress is False and cfg.train.reschedule is True
    for args in (["--overwrite"], ["--overwrite=true"], ["--overwrite", "yes"]):
        assert parse(PrepareConfig, ["--source", "x", "--out_dir", "y", *args], prog="prepare").overwrite is True
    assert not parse(PrepareConfig, ["--source", "x", "--out_dir", "y", "--no-overwrite"], prog="prepare").overwrite
    assert parse(EvalConfig, ["--run_dir=r", "--all=True", "--no-wandb"], prog="eval.py").all is True


def test_a_train_call_that_cannot_fit_the_machine_is_refused_before_its_first_step(shakespeare, tmp_path, monkeypatch):
    """The compiled call's memory (XLA's analysis) against what the host has free: one line naming the flags, and
    no step taken (the kernel's OOM killer would leave nothing to read)."""
    from trainer.program import memory

    monkeypatch.setattr(memory, "available_bytes", lambda: 2**20)  # 1 MiB free
    code, _, stderr = run_main(train_app.main, "--run_dir", str(tmp_path / "run"), f"--data.cache_dir={shakespeare}",
                               *SMALL)
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr[-2000:]
    assert stderr.startswith("error: the train call needs ") and "but this machine has 0.0 GiB free: lower" \
        " --train.batch_size (now 8) or raise --train.grad_accum (now 1)" in stderr
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or '"loss"' not in metrics.read_text()
