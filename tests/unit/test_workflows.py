"""What users do besides pre-training, the checks that end a command before any work: export, --init_from and
lm-eval tasks errors in one line; lm-eval's padded shapes; no hub means offline at once. The runs: tests/e2e."""

import json

import pytest

import eval as eval_app
import train as train_app
from support.cli import last_line, run_main
from support.cli import export_error, fsdp_tp_run_args

transformers = pytest.importorskip("transformers")
lm_eval = pytest.importorskip("lm_eval")

HF_CONFIG = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 64, "n_layer": 2, "n_head": 2, "n_embd": 32}


def test_export_errors_are_one_line_before_any_work(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    assert "--out " + str(tmp_path / "full") + ": exists and is not an empty directory" in export_error(
        "--run_dir", str(tmp_path), "--out", str(tmp_path / "full"))
    assert f"{tmp_path / 'checkpoints'}: no checkpoints to export" in export_error("--run_dir", str(tmp_path),
                                                                                   "--out", str(tmp_path / "y"))
    assert "--out" in export_error("--run_dir", str(tmp_path))
    assert not (tmp_path / "y").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model.n_layer=3"], "sets the architecture, and --model.n_layer=3 (the checkpoint has 2) contradicts it"),
        (["--model.n-embd", "64"], "--model.n_embd=64 (the checkpoint has 32) contradicts it; drop the flag"),
        (["--train.seq_len=128"], "train.seq_len=128 exceeds model.block_size=64"),
    ],
)
def test_init_from_conflicts_are_one_line_before_any_work(shakespeare, tmp_path, args, message):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(HF_CONFIG))  # all that is read before any work
    code, _, err = run_main(train_app.main, *fsdp_tp_run_args(tmp_path / "r", shakespeare, "--init_from",
                                                        str(tmp_path / "hf")), *args)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert message in err and not (tmp_path / "r").exists()


def test_init_from_a_missing_directory_is_one_line(shakespeare, tmp_path):
    code, _, err = run_main(train_app.main, *fsdp_tp_run_args(tmp_path / "r", shakespeare, "--init_from",
                                                        str(tmp_path / "nope")))
    assert code == 2 and f"--init_from: {tmp_path / 'nope'}: no such directory" in last_line(err)


def test_padded_lengths_are_a_few_fixed_ones():
    from trainer.eval.harness import buckets

    assert buckets(1024) == [64, 128, 256, 512, 1024]
    assert (buckets(100), buckets(64), buckets(32)) == ([64, 100], [64], [32])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tasks", "tiny_mc", "--include_path", "/nonexistent"], "--include_path /nonexistent: no such directory"),
        (["--tasks", "tiny_mc", "--limit", "0"], "--limit must be an integer >= 1, got 0"),
        (["--tasks", " , "], "--tasks ' , ' names no task"),
        (["--tasks", "tiny_mcq", "--include_path", "TASKS"], "--tasks: no lm-eval task 'tiny_mcq' (did you mean"
                                                              " tiny_mc"),
        (["--tasks", "lambada_openai"], "--tasks: cannot load the tasks' documents"),  # a hub task, no network
    ],
)
def test_eval_task_errors_are_one_line_before_any_work(tasks_dir, tmp_path, monkeypatch, args, message):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = [a.replace("TASKS", str(tasks_dir)) for a in args]
    code, _, err = run_main(eval_app.main, "--hf", str(tmp_path), "--out", str(tmp_path / "r.json"), *args)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert message in err


def test_with_no_hub_the_hub_libraries_go_offline_at_once(monkeypatch):
    """No network: one refused connection puts huggingface_hub and datasets offline, so a hub task fails in one
    line at once instead of after ~25 s of retries per file (and a cached dataset still loads)."""
    import time

    import datasets
    from huggingface_hub import constants

    from tools.launch import free_port
    from trainer.eval.harness import offline_without_hub

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"https://127.0.0.1:{free_port()}")  # nothing listens there
    started = time.monotonic()
    offline_without_hub()
    assert constants.HF_HUB_OFFLINE and datasets.config.HF_HUB_OFFLINE
    assert time.monotonic() - started < 3


def test_a_benchmark_that_cannot_load_stops_training_before_it_starts(tmp_path, shakespeare, monkeypatch):
    """A hub task with no network: one line at start-up, nothing written."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run_main(train_app.main, *fsdp_tp_run_args(tmp_path / "run", shakespeare,
                                                          "--train.eval_tasks=lambada_openai"))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "train.eval_tasks: cannot load the tasks' documents" in err and "train.include_path" in err
    assert not (tmp_path / "run").exists()


def test_the_check_before_the_run_and_its_evaluations_share_one_task_index(tasks_dir):
    """Indexing lm-eval's built-in tasks takes ~7 s: the start-up check (which names the run's flags in its
    errors) and every evaluation after it (whatever tasks it asks for) read the same index of a folder."""
    from trainer.eval.harness import task_manager

    checked = task_manager("tiny_mc", str(tasks_dir), ("--train.eval_tasks", "--train.include_path"))
    assert task_manager("tiny_mc,tiny_rolling", str(tasks_dir)) is checked
