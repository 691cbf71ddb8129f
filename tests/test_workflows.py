"""What users do besides pre-training, each checked against the real libraries on one small run per module:
export to Hugging Face with the tokenizer (`python -m tools.export_hf`: transformers and its pipeline load it,
the tokenizer encodes as tiktoken), fine-tune from those weights (`train.py --init_from`: the first loss is
transformers' own), and lm-evaluation-harness tasks (`eval.py --tasks`: our adapter against lm-eval's `hf`
backend on the same weights). Entry points run in-process (`run_main`); the tests that train, export or
evaluate are in the slow tier, the checks that end a command before any work are not."""

import itertools
import json
import lzma
import shutil

import numpy as np
import pytest

import eval as eval_app
import train as train_app
from conftest import ROOT, SMALL, last_line, read_jsonl, run_main, step_losses
from tools import export_hf

transformers = pytest.importorskip("transformers")
lm_eval = pytest.importorskip("lm_eval")

with lzma.open(ROOT / "data/assets/shakespeare.jsonl.xz", "rt") as f:
    ASSETS_TEXT = [json.loads(line)["text"] for line in itertools.islice(f, 2)]  # two works of the corpus

# The tokenizer's test sample: unicode, emoji, CJK, whitespace runs, numbers, code, contractions, <|endoftext|>.
TEXTS = [
    "ROMEO: hello", "  leading  and   trailing   ", "tabs\t\tand\nnewlines\n\n\n  \n", "\r\ncrlf\r\n\u00a0nbsp\u2003",
    "héllo wörld ünïcödé — “quotes” «guillemets»", "日本語のテキスト 中文 한국어 العربية", "emoji 🤖🎉👨‍👩‍👧 ok",
    "<|endoftext|>after<|endoftext|> <|endoftext|>", "numbers 1234567 3.14159 1,000,000 2024-01-31",
    "def f(x):\n    return x**2  # code\n\treturn {'a': [1, 2]}\n", "I'm you're they'll we've he'd SHE'S 'tis",
    "a" * 60 + " " + "ab" * 30 + "   " + "!" * 10, "", " ", ASSETS_TEXT[0][:20_000],
]


HF_CONFIG = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 64, "n_layer": 2, "n_head": 2, "n_embd": 32}


def train_args(run_dir, shakespeare, *extra):
    """2 steps of the small model on a 2×2×2 data × fsdp × tensor mesh (parameters split over 4 devices)."""
    return ["--run_dir", str(run_dir), f"--data.cache_dir={shakespeare}", *SMALL, "--train.steps=2",
            "--checkpoint.every=2", "--train.eval_every=0", "--mesh.data=2", "--mesh.fsdp=2", "--mesh.tensor=2",
            "--mesh.rules=fsdp_tp", *extra]


@pytest.fixture(scope="module")
def run(tmp_path_factory, shakespeare):
    """A 2-step run with checkpoints at steps 1 and 2, logged to an offline wandb run."""
    run_dir = tmp_path_factory.mktemp("run")
    code, _, err = run_main(train_app.main, *train_args(run_dir, shakespeare, "--log.wandb=offline",
                                                        "--checkpoint.every=1"))
    assert code == 0, err[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "hf"
    code, stdout, err = run_main(export_hf.main, "--run_dir", str(run), "--out", str(out))
    assert code == 0, err[-3000:]
    assert f"exported {run / 'checkpoints' / '2'} to {out}" in stdout
    return out


# ---- export ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_export_loads_in_transformers_and_its_pipeline_offline(exported, monkeypatch):
    """The exported weights are the checkpoint's (logits ≤ 1e-4) and `pipeline("text-generation")` continues a
    prompt greedily with the same tokens as our own sampler."""
    import jax
    import torch

    from gpt2.generate import generate
    from gpt2.hf import from_hf

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = transformers.GPT2LMHeadModel.from_pretrained(exported).eval()
    ours = from_hf(exported)
    ids = np.array([[50256, 49, 2662, 46, 25, 12, 7, 1000]])
    with torch.no_grad():
        np.testing.assert_allclose(hf(torch.tensor(ids)).logits.numpy(), np.asarray(ours(ids))[..., :50257],
                                   atol=1e-4)
    from data.tokenizer import get_tokenizer

    tokens = generate(ours, np.array([get_tokenizer().encode("ROMEO:")]), 6, key=jax.random.PRNGKey(0),
                      temperature=0.0)
    pipe = transformers.pipeline("text-generation", model=str(exported), device="cpu")
    (out,) = pipe("ROMEO:", max_new_tokens=6, do_sample=False)
    assert out["generated_text"] == get_tokenizer().decode(np.asarray(tokens[0]).tolist())


@pytest.mark.slow
def test_exported_tokenizer_encodes_and_decodes_as_tiktoken(exported, monkeypatch):
    from data.tokenizer import get_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = transformers.AutoTokenizer.from_pretrained(exported)
    enc = get_tokenizer()
    for text in TEXTS:
        ids = enc.encode(text, allowed_special="all")
        assert hf.encode(text, add_special_tokens=False) == ids, text[:80]
        assert hf.decode(ids) == enc.decode(ids), text[:80]
    assert hf("ROMEO: hello")["input_ids"] == enc.encode("ROMEO: hello") != []  # the issue's case: it was []
    assert (hf.eos_token_id, hf.bos_token_id, len(hf)) == (50256, 50256, 50257)


def export_error(*args) -> str:
    code, _, err = run_main(export_hf.main, *args)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    return last_line(err)


def test_export_errors_are_one_line_before_any_work(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    assert "--out " + str(tmp_path / "full") + ": exists and is not an empty directory" in export_error(
        "--run_dir", str(tmp_path), "--out", str(tmp_path / "full"))
    assert f"{tmp_path / 'checkpoints'}: no checkpoints to export" in export_error("--run_dir", str(tmp_path),
                                                                                   "--out", str(tmp_path / "y"))
    assert "--out" in export_error("--run_dir", str(tmp_path))
    assert not (tmp_path / "y").exists()


@pytest.mark.slow
def test_export_of_a_missing_step_names_the_steps(run, tmp_path):
    assert "no checkpoint at step 7; steps: [1, 2]" in export_error("--run_dir", str(run), "--step", "7", "--out",
                                                                   str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()


# ---- fine-tuning -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_init_from_starts_at_the_weights_and_a_resume_continues_the_fine_tune(run, exported, shakespeare, tmp_path):
    """On the 2×2×2 mesh, step 1's loss is transformers' loss of the exported model on the same batch (≤ 1e-4),
    not the loss of the run's own random initialization there; a second start resumes from the fine-tune's
    own checkpoint."""
    import torch

    from configs import from_dict
    from data.loader import make_dataset
    from trainer.corpus import resolve_corpus, train_loader_config

    run_dir = tmp_path / "finetune"
    code, out, err = run_main(train_app.main, *train_args(run_dir, shakespeare, "--init_from", str(exported)))
    assert code == 0, err[-3000:]
    assert f"initialized from {exported}" in out
    cfg = from_dict(json.loads((run_dir / "config.json").read_text()))
    corpus = resolve_corpus(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.train.seq_len)
    batch = next(iter(make_dataset(corpus.files("train"), cfg.model.vocab_size, train_loader_config(cfg))))
    hf = transformers.GPT2LMHeadModel.from_pretrained(exported).eval()
    x, y = (torch.tensor(batch[:, i], dtype=torch.long) for i in (slice(None, -1), slice(1, None)))
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    losses = step_losses(run_dir)
    assert abs(losses[0] - expected) <= 1e-4, (losses[0], expected)
    assert abs(losses[0] - step_losses(run)[0]) > 1e-3  # the same batch, from the random initialization

    code, out, err = run_main(train_app.main, *train_args(run_dir, shakespeare, "--init_from", str(exported),
                                                          "--train.steps=3"))
    assert code == 0, err[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / '2'}" in out and "initialized from" not in out
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r] == [1, 2, 3]
    assert step_losses(run_dir)[:2] == losses


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
    code, _, err = run_main(train_app.main, *train_args(tmp_path / "r", shakespeare, "--init_from",
                                                        str(tmp_path / "hf")), *args)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert message in err and not (tmp_path / "r").exists()


def test_init_from_a_missing_directory_is_one_line(shakespeare, tmp_path):
    code, _, err = run_main(train_app.main, *train_args(tmp_path / "r", shakespeare, "--init_from",
                                                        str(tmp_path / "nope")))
    assert code == 2 and f"--init_from: {tmp_path / 'nope'}: no such directory" in last_line(err)


# ---- lm-evaluation-harness -----------------------------------------------------------------------------

MC = [  # a HellaSwag-like multiple choice: the most likely ending
    ("To be, or not to be, that is the", [" question", " answer", " problem", " end"], 0),
    ("Now is the winter of our", [" discontent", " summer", " joy", " house"], 0),
    ("A horse! a horse! my kingdom for a", [" horse", " crown", " sword", " cup"], 0),
    ("Romeo, Romeo! wherefore art thou", [" Romeo", " here", " gone", " there"], 0),
    ("All the world's a", [" stage", " world", " play", " dream"], 0),
    ("The course of true love never did run", [" smooth", " fast", " far", " dry"], 0),
]
GEN = [("KING HENRY:\n", "Once"), ("To be, or not to be", ", that"), ("O", "ROMEO"), ("What", "!")]


def write_tasks(directory):
    """Three local lm-eval tasks (task YAML + jsonl, absolute data paths: no hub): multiple choice,
    loglikelihood_rolling over documents longer than the context, and greedy generation."""
    def task(name, docs, body):
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (directory / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\n{body}")

    task("tiny_mc", [{"q": q, "choices": c, "label": a} for q, c, a in MC],
         "output_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\n"
         "doc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    docs = [ASSETS_TEXT[0][:1500], ASSETS_TEXT[1][:400], "naïve café — “quotes” 日本語 🤖\n\n  spaces   end",
            "short"]
    task("tiny_rolling", [{"text": t} for t in docs],
         "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
         "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    task("tiny_gen", [{"prompt": p, "answer": a} for p, a in GEN],
         "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\n"
         "generation_kwargs:\n  until: [\"\\n\\n\", \"!!!\"]\n  max_gen_toks: 12\n  do_sample: false\n"
         "metric_list:\n  - metric: exact_match\n")
    return directory


TASKS = ["tiny_mc", "tiny_rolling", "tiny_gen"]


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    return write_tasks(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def hf_backend(exported, tasks_dir):
    """lm-eval's own `hf` backend on the exported weights and tokenizer: the reference."""
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(exported), "dtype": "float32"},
                                   tasks=TASKS, batch_size=8, device="cpu", log_samples=True,
                                   task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False))


def per_request(results, task):
    """[(doc id, request index, response)] of one task's logged samples."""
    return [(s["doc_id"], i, r[0]) for s in results["samples"][task] for i, r in enumerate(s["resps"])]


@pytest.mark.slow
def test_lm_eval_adapter_matches_the_hf_backend(run, tasks_dir, hf_backend):
    """On a 4×2 data × fsdp mesh: the same accuracies, per-request log-likelihoods within 1e-4 (for
    documents of up to 8 windows of 64 tokens, 1e-4 + 1e-6 relative; measured ≤ 2e-6 per choice and 1.1e-4 on
    a -2,162 document), the same greedy flags and generated text; one compile for every request."""
    import jax
    from lm_eval.tasks import TaskManager

    from configs import from_dict
    from configs.base import CheckpointConfig
    from gpt2.sharding import ShardingRules
    from trainer.program.mesh import make_mesh
    from trainer.eval.harness import GPT2LM, score
    from trainer.program.evaluator import Evaluator
    from trainer.storage.checkpoints import Checkpoints

    ckpt = Checkpoints(run, CheckpointConfig(), read_only=True)
    model_config = from_dict(ckpt.read_meta(2)["config"]).model
    evaluator = Evaluator.build(model_config, make_mesh(data=4, fsdp=2), ShardingRules.preset("fsdp"))
    with jax.set_mesh(evaluator.layout.mesh):
        params = ckpt.restore_params(2, evaluator.layout.abstract_params)
    ckpt.close()
    lm = GPT2LM(evaluator, params, batch_size=8, max_length=model_config.block_size)
    compiled = score._cache_size()
    ours = lm_eval.simple_evaluate(model=lm, tasks=TASKS, log_samples=True,
                                   task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False))
    assert score._cache_size() == compiled + 1  # every request padded to the one length (64) this context allows

    for task in ("tiny_mc", "tiny_rolling"):
        theirs = per_request(hf_backend, task)
        mine = per_request(ours, task)
        assert [m[:2] for m in mine] == [t[:2] for t in theirs]
        for (_, _, a), (_, _, b) in zip(mine, theirs):
            a, b = (a, None) if isinstance(a, float) else a, (b, None) if isinstance(b, float) else b
            assert abs(float(a[0]) - float(b[0])) <= 1e-4 + 1e-6 * abs(float(b[0])), (task, a, b)
            assert a[1] == b[1]
    generated = [r for _, _, r in per_request(ours, "tiny_gen")]
    assert generated == [r for _, _, r in per_request(hf_backend, "tiny_gen")] and any(generated)
    for task, metric in (("tiny_mc", "acc,none"), ("tiny_mc", "acc_norm,none"), ("tiny_gen", "exact_match,none")):
        assert ours["results"][task][metric] == hf_backend["results"][task][metric]
    for task in TASKS:
        theirs = {k: v for k, v in hf_backend["results"][task].items() if isinstance(v, float)}
        assert {k: ours["results"][task][k] for k in theirs} == pytest.approx(theirs, rel=1e-6, abs=1e-4)


def test_padded_lengths_are_a_few_fixed_ones():
    from trainer.eval.harness import buckets

    assert buckets(1024) == [64, 128, 256, 512, 1024]
    assert (buckets(100), buckets(64), buckets(32)) == ([64, 100], [64], [32])


@pytest.mark.slow
def test_eval_tasks_records_results_in_eval_json_and_the_runs_wandb(run, tasks_dir, hf_backend, tmp_path):
    """`eval.py --run_dir R --all --tasks ...` (the CLI, 8 devices, its default mesh): one compile serves both
    checkpoints; step 2's accuracy on the first 4 documents equals lm-eval's `hf` backend's on them; eval.json
    and the training run's wandb run hold the figures."""
    from test_cli import wandb_records

    from trainer.eval.harness import score

    run_dir = tmp_path / "run"
    shutil.copytree(run, run_dir)
    compiled = score._cache_size()
    code, out, err = run_main(eval_app.main, "--run_dir", str(run_dir), "--all", "--tasks", "tiny_mc,tiny_rolling",
                              "--include_path", str(tasks_dir), "--limit", "4")
    assert code == 0, err[-3000:]
    assert score._cache_size() == compiled + 1
    assert "step 2: lm-eval tiny_mc,tiny_rolling (max_length 64, limit 4)" in out and "step 1: lm-eval" in out
    records = json.loads((run_dir / "eval.json").read_text())["results"]
    assert [r["step"] for r in records] == [1, 2]
    record = records[1]
    assert record["key"] == "step=2,tasks=tiny_mc,tiny_rolling,limit=4,max_length=64"
    assert record["documents"] == {"tiny_mc": 4, "tiny_rolling": 4}
    reference = [s for s in hf_backend["samples"]["tiny_mc"] if s["doc_id"] < 4]
    for metric in ("acc", "acc_norm"):
        assert record["lm_eval"]["tiny_mc"][metric] == np.mean([s[metric] for s in reference])
    logged = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item}
              for path in (run_dir / "wandb").glob("offline-run-*/run-*.wandb") for rec in wandb_records(path)
              if rec.WhichOneof("record_type") == "history"]
    (figures,) = [h for h in logged if h.get("eval/step") == 2]
    assert figures["eval/tiny_mc/acc"] == record["lm_eval"]["tiny_mc"]["acc"]
    assert figures["eval/tiny_rolling/word_perplexity"] == record["lm_eval"]["tiny_rolling"]["word_perplexity"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tasks", "tiny_mc", "--include_path", "/nonexistent"], "--include_path /nonexistent: no such directory"),
        (["--tasks", "tiny_mc", "--limit", "0"], "--limit must be >= 1, got 0"),
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


# ---- benchmarks during training ---------------------------------------------------------------------


@pytest.mark.slow
def test_benchmarks_during_training_are_logged_and_match_the_hf_backend(tasks_dir, hf_backend, shakespeare, tmp_path):
    """train.eval_tasks at the step-2 evaluation of the same 2-step run as `run` (so the same weights as the
    exported checkpoint): its accuracy on 4 documents equals lm-eval's `hf` backend's, in metrics.jsonl (as
    wandb's eval/<task>/<metric>), eval.json and the console line with its time."""
    run_dir = tmp_path / "run"
    code, out, err = run_main(train_app.main, *train_args(run_dir, shakespeare, "--train.eval_every=2",
                                                          "--train.eval_tasks=tiny_mc", "--train.eval_limit=4",
                                                          f"--train.include_path={tasks_dir}"))
    assert code == 0, err[-3000:]
    reference = np.mean([s["acc"] for s in hf_backend["samples"]["tiny_mc"] if s["doc_id"] < 4])
    (logged,) = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "eval/tiny_mc/acc" in r]
    assert logged["step"] == 2 and logged["eval/tiny_mc/acc"] == reference
    (record,) = json.loads((run_dir / "eval.json").read_text())["results"]
    assert record["key"] == "step=2,tasks=tiny_mc,limit=4,max_length=64" and record["lm_eval"]["tiny_mc"]["acc"] == reference
    assert f"step 2: tiny_mc/acc {reference:.4g}" in out + err and " s)" in out + err


def test_a_benchmark_that_cannot_load_stops_training_before_it_starts(tmp_path, shakespeare, monkeypatch):
    """A hub task with no network: one line at start-up, nothing written."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run_main(train_app.main, *train_args(tmp_path / "run", shakespeare, "--train.eval_tasks=lambada_openai"))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "train.eval_tasks: cannot load the tasks' documents" in err and "train.include_path" in err
    assert not (tmp_path / "run").exists()
