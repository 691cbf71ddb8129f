"""What users do besides pre-training, each checked against the real libraries on one small run per module:
export to Hugging Face with the tokenizer (`python -m tools.export_hf`: transformers and its pipeline load it,
the tokenizer encodes as tiktoken), fine-tune from those weights (`train.py --init_from`: the first loss is
transformers' own), and lm-evaluation-harness tasks (`eval.py --tasks`: our adapter against lm-eval's `hf`
backend on the same weights). Entry points run in-process (`run_main`)."""

import json
import shutil

import numpy as np
import pytest

import eval as eval_app
import train as train_app
from support.cli import read_jsonl, run_main, step_losses
from support.lm_eval_tasks import ASSETS_TEXT
from support.cli import export_error, fsdp_tp_run_args
from tools import export_hf

transformers = pytest.importorskip("transformers")
lm_eval = pytest.importorskip("lm_eval")

# The tokenizer's test sample: unicode, emoji, CJK, whitespace runs, numbers, code, contractions, <|endoftext|>.
TEXTS = [
    "ROMEO: hello", "  leading  and   trailing   ", "tabs\t\tand\nnewlines\n\n\n  \n", "\r\ncrlf\r\n\u00a0nbsp\u2003",
    "héllo wörld ünïcödé — “quotes” «guillemets»", "日本語のテキスト 中文 한국어 العربية", "emoji 🤖🎉👨‍👩‍👧 ok",
    "<|endoftext|>after<|endoftext|> <|endoftext|>", "numbers 1234567 3.14159 1,000,000 2024-01-31",
    "def f(x):\n    return x**2  # code\n\treturn {'a': [1, 2]}\n", "I'm you're they'll we've he'd SHE'S 'tis",
    "a" * 60 + " " + "ab" * 30 + "   " + "!" * 10, "", " ", ASSETS_TEXT[0][:20_000],
]


HF_CONFIG = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 64, "n_layer": 2, "n_head": 2, "n_embd": 32}


@pytest.fixture(scope="module")
def run(tmp_path_factory, shakespeare):
    """A 2-step run with checkpoints at steps 1 and 2, logged to an offline wandb run."""
    run_dir = tmp_path_factory.mktemp("run")
    code, _, err = run_main(train_app.main, *fsdp_tp_run_args(run_dir, shakespeare, "--log.wandb=offline",
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


def test_export_of_a_missing_step_names_the_steps(run, tmp_path):
    assert "no checkpoint at step 7; steps: [1, 2]" in export_error("--run_dir", str(run), "--step", "7", "--out",
                                                                   str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()


def test_init_from_starts_at_the_weights_and_a_resume_continues_the_fine_tune(run, exported, shakespeare, tmp_path):
    """On the 2×2×2 mesh, step 1's loss is transformers' loss of the exported model on the same batch (≤ 1e-4),
    not the loss of the run's own random initialization there; a second start resumes from the fine-tune's
    own checkpoint."""
    import torch

    from configs import from_dict
    from data.loader import make_dataset
    from trainer.corpus import resolve_corpus, train_loader_config

    run_dir = tmp_path / "finetune"
    code, out, err = run_main(train_app.main, *fsdp_tp_run_args(run_dir, shakespeare, "--init_from", str(exported)))
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

    code, out, err = run_main(train_app.main, *fsdp_tp_run_args(run_dir, shakespeare, "--init_from", str(exported),
                                                          "--train.steps=3"))
    assert code == 0, err[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / '2'}" in out and "initialized from" not in out
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r] == [1, 2, 3]
    assert step_losses(run_dir)[:2] == losses


TASKS = ["tiny_mc", "tiny_rolling", "tiny_gen"]


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


def test_eval_tasks_records_results_in_eval_json_and_the_runs_wandb(run, tasks_dir, hf_backend, tmp_path):
    """`eval.py --run_dir R --all --tasks ...` (the CLI, 8 devices, its default mesh): one compile serves both
    checkpoints; step 2's accuracy on the first 4 documents equals lm-eval's `hf` backend's on them; eval.json
    and the training run's wandb run hold the figures."""
    from support.cli import wandb_records

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


def test_eval_tasks_on_hub_weights_resolved_offline_from_the_local_cache(exported, tasks_dir, hf_backend, tmp_path,
                                                                       monkeypatch):
    """`eval.py --hf hub:NAME --tasks ... --out R` (no corpus: the tasks bring their documents) with the hub offline
    (HF_HUB_OFFLINE, HF_HUB_CACHE): the name resolves to the local cache's snapshot, and the accuracy on the first 4
    documents is lm-eval's `hf` backend's on the same weights."""
    from huggingface_hub import constants

    cache, revision = tmp_path / "hub", "0" * 40  # the cache's layout: huggingface_hub's file_download.py
    snapshot = cache / "models--local--tiny-gpt2" / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for f in [exported / "config.json", *exported.glob("*.safetensors")]:
        shutil.copy(f, snapshot)
    (cache / "models--local--tiny-gpt2" / "refs").mkdir()
    (cache / "models--local--tiny-gpt2" / "refs" / "main").write_text(revision)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    out = tmp_path / "results.json"
    code, stdout, err = run_main(eval_app.main, "--hf", "hub:local/tiny-gpt2", "--tasks", "tiny_mc", "--include_path",
                                 str(tasks_dir), "--limit", "4", "--out", str(out))
    assert code == 0, err[-3000:]
    (record,) = json.loads(out.read_text())["results"]
    reference = np.mean([s["acc"] for s in hf_backend["samples"]["tiny_mc"] if s["doc_id"] < 4])
    assert record["model"] == "hub:local/tiny-gpt2" and record["lm_eval"]["tiny_mc"]["acc"] == reference
    assert f"results: {out}" in stdout


def test_benchmarks_during_training_are_logged_and_match_the_hf_backend(tasks_dir, hf_backend, shakespeare, tmp_path):
    """train.eval_tasks at the step-2 evaluation of the same 2-step run as `run` (so the same weights as the
    exported checkpoint): its accuracy on 4 documents equals lm-eval's `hf` backend's, in metrics.jsonl (as
    wandb's eval/<task>/<metric>), eval.json and the console line with its time."""
    run_dir = tmp_path / "run"
    code, out, err = run_main(train_app.main, *fsdp_tp_run_args(run_dir, shakespeare, "--train.eval_every=2",
                                                          "--train.eval_tasks=tiny_mc", "--train.eval_limit=4",
                                                          f"--train.include_path={tasks_dir}"))
    assert code == 0, err[-3000:]
    reference = np.mean([s["acc"] for s in hf_backend["samples"]["tiny_mc"] if s["doc_id"] < 4])
    (logged,) = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "eval/tiny_mc/acc" in r]
    assert logged["step"] == 2 and logged["eval/tiny_mc/acc"] == reference
    (record,) = json.loads((run_dir / "eval.json").read_text())["results"]
    assert record["key"] == "step=2,tasks=tiny_mc,limit=4,max_length=64" and record["lm_eval"]["tiny_mc"]["acc"] == reference
    assert f"step 2: tiny_mc/acc {reference:.4g}" in out + err and " s)" in out + err
