"""Evaluate and sample from saved checkpoints (or Hugging Face GPT-2 weights).

    python eval.py --run_dir runs/shakespeare_cpu                 # latest checkpoint, whole val split
    python eval.py --run_dir runs/shakespeare_cpu --all           # every checkpoint in the run
    python eval.py --run_dir runs/shakespeare_cpu --step 400 --batches 20 --prompt "ROMEO:"
    python eval.py --hf /path/to/hf-gpt2 --dataset /data/owt      # imported HF weights

Checkpoints restore onto whatever devices this machine has (any device count or mesh). Results go to
<run_dir>/eval.json and, when the run used wandb, to the same wandb run as `eval/*` metrics.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import jax

from configs.base import Config, MeshConfig
from configs.cli import fail, parse
from data.prepare import DataError
from gpt2.config import ConfigError
from trainer.checkpoint import CheckpointError, Checkpoints, check_compatible, config_from_meta
from trainer.evaluation import encode_prompt, mean_loss, sample
from trainer.host import keep_freed_memory
from trainer.setup import build_mesh, initialize_distributed, resolve_corpus, val_dataset
from trainer.step import Trainer


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Evaluation and sampling.

    Attributes:
      run_dir: a training run directory (with checkpoints/).
      hf: instead of a run: a Hugging Face GPT-2 directory (config.json + safetensors) or hub name.
      step: the checkpoint to evaluate (default: the latest).
      all: evaluate every checkpoint in the run.
      batches: validation batches to average (default: the whole validation split).
      batch_size: sequences per batch (global).
      seq_len: tokens per sequence (default: the run's train.seq_len; HF: 1024).
      dataset: corpus to evaluate on (default: the run's).
      prompt: sample a continuation of this text after evaluating.
      max_new_tokens: tokens to sample.
      temperature: sampling temperature (0: greedy).
      top_k: sample among the k most likely tokens only.
      seed: sampling seed.
      out: results JSON (default: <run_dir>/eval.json).
      wandb: also log to the training run's wandb run.
      mesh: the device mesh to evaluate on (independent of the one training used).
    """

    run_dir: str | None = None
    hf: str | None = None
    step: int | None = None
    all: bool = False
    batches: int | None = None
    batch_size: int = 8
    seq_len: int | None = None
    dataset: str | None = None
    prompt: str | None = None
    max_new_tokens: int = 100
    temperature: float = 0.8
    top_k: int | None = 200
    seed: int = 0
    out: str | None = None
    wandb: bool = True
    mesh: MeshConfig = MeshConfig(rules="fsdp")


def main(argv: list[str] | None = None) -> int:
    keep_freed_memory()  # before JAX starts its threads: see trainer/host.py
    try:
        cfg = parse(EvalConfig, argv, prog="eval.py", bool_flags=True)
        if (cfg.run_dir is None) == (cfg.hf is None):
            raise ConfigError("give exactly one of --run_dir (a training run) or --hf (Hugging Face weights)")
        return evaluate_hf(cfg) if cfg.hf else evaluate_run(cfg)
    except (ConfigError, DataError, CheckpointError, FileNotFoundError, ValueError) as e:
        fail(str(e))


def evaluate_run(cfg: EvalConfig) -> int:
    ckpt = Checkpoints(cfg.run_dir, Config().checkpoint, read_only=True)
    steps = ckpt.all_steps() if ckpt.directory.exists() else []
    if not steps:
        raise CheckpointError(f"{ckpt.directory}: no checkpoints to evaluate")
    if cfg.step is not None and cfg.step not in steps:
        raise CheckpointError(f"{ckpt.directory}: no checkpoint at step {cfg.step}; steps: {steps}")
    chosen = steps if cfg.all else [cfg.step if cfg.step is not None else steps[-1]]
    meta = ckpt.read_meta(chosen[-1])
    run_cfg = eval_run_config(config_from_meta(meta), cfg)
    initialize_distributed(run_cfg)
    mesh = build_mesh(run_cfg)
    trainer = Trainer.build(run_cfg, mesh)
    corpus = resolve_corpus(run_cfg)
    if cfg.prompt is not None:
        prompt_ids(cfg, run_cfg.model.block_size)  # a prompt that cannot fit fails before any work
    results = {}
    with jax.set_mesh(mesh):
        for step in chosen:
            check_compatible(ckpt.read_meta(step), run_cfg, ckpt.directory)
            params = ckpt.restore_params(step, trainer.abstract_params)
            results[step] = validation(run_cfg, trainer, params, corpus, cfg.batches)
            report(step, results[step])
            if cfg.prompt is not None:
                print(sample_text(trainer.model(params), cfg))
    ckpt.close()
    out = Path(cfg.out) if cfg.out else Path(cfg.run_dir) / "eval.json"
    save_results(out, results)
    if cfg.wandb and meta.get("wandb_id") and run_cfg.log.wandb != "disabled":
        log_to_wandb(run_cfg, Path(cfg.run_dir), meta["wandb_id"], results)
    return 0


def evaluate_hf(cfg: EvalConfig) -> int:
    from gpt2.hf import from_hf

    base = Config()
    probe = eval_run_config(base, cfg)
    initialize_distributed(probe)
    mesh = build_mesh(probe)
    with jax.set_mesh(mesh):
        model = from_hf(cfg.hf, mesh=mesh, rules=cfg.mesh.rules)
        seq_len = cfg.seq_len or min(1024, model.config.block_size)
        run_cfg = dataclasses.replace(probe, model=model.config,
                                      train=dataclasses.replace(probe.train, seq_len=seq_len))
        trainer = Trainer.build(run_cfg, mesh)
        corpus = resolve_corpus(run_cfg)
        from flax import nnx

        result = validation(run_cfg, trainer, nnx.state(model, nnx.Param), corpus, cfg.batches)
        report(None, result)
        if cfg.prompt is not None:
            print(sample_text(model, cfg))
    save_results(Path(cfg.out or "eval_hf.json"), {"hf": result})
    return 0


def eval_run_config(run: Config, cfg: EvalConfig) -> Config:
    """The training config adapted to evaluation on this machine's devices."""
    data = run.data if cfg.dataset is None else dataclasses.replace(run.data, dataset=cfg.dataset)
    train = dataclasses.replace(run.train, batch_size=cfg.batch_size, grad_accum=1,
                                seq_len=cfg.seq_len or run.train.seq_len)
    return dataclasses.replace(run, data=data, train=train, mesh=cfg.mesh,
                               distributed=run.distributed.__class__())


def validation(cfg: Config, trainer: Trainer, params, corpus, batches: int | None) -> dict:
    """Mean next-token loss over `batches` validation batches (default: all complete ones)."""
    dataset = val_dataset(cfg, corpus, cfg.train.batch_size, num_epochs=1)
    loss, n = mean_loss(trainer, trainer.eval_call(), params, dataset, batches)
    if n == 0:
        raise DataError(f"{corpus.directory}: validation split is smaller than one batch")
    return {"val_loss": loss, "perplexity": math.exp(loss), "batches": n,
            "tokens": n * cfg.train.batch_size * cfg.train.seq_len}


def report(step, r: dict) -> None:
    if jax.process_index() == 0:
        where = f"step {step}" if step is not None else "model"
        print(f"{where}: val_loss {r['val_loss']:.4f}  perplexity {r['perplexity']:.2f}"
              f"  ({r['batches']} batches, {r['tokens']:,} tokens)")


def sample_text(model, cfg: EvalConfig) -> str:
    return sample(model, prompt_ids(cfg, model.config.block_size), cfg.max_new_tokens, seed=cfg.seed,
                  temperature=cfg.temperature, top_k=cfg.top_k)


def prompt_ids(cfg: EvalConfig, block_size: int) -> list[int]:
    prompt = encode_prompt(cfg.prompt)
    if len(prompt) + cfg.max_new_tokens > block_size:
        raise ConfigError(
            f"--prompt encodes to {len(prompt)} tokens; with --max_new_tokens={cfg.max_new_tokens} that exceeds"
            f" the model's context of {block_size}"
        )
    return prompt


def save_results(path: Path, results: dict) -> None:
    if jax.process_index() != 0:
        return
    existing = json.loads(path.read_text()) if path.exists() else {}
    existing.update({str(k): v for k, v in results.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(existing, indent=2))
    os.replace(tmp, path)
    print(f"results: {path}")


def log_to_wandb(cfg: Config, run_dir: Path, wandb_id: str, results: dict) -> None:
    """Adds `eval/*` metrics to the training run, keyed by the checkpoint step."""
    if jax.process_index() != 0:
        return
    import wandb

    mode = "offline" if cfg.log.wandb in ("offline", "auto") and not os.environ.get("WANDB_API_KEY") else "online"
    run = wandb.init(project=cfg.log.project, id=wandb_id, resume="allow", dir=str(run_dir), mode=mode)
    run.define_metric("eval/step")
    run.define_metric("eval/*", step_metric="eval/step")
    for step, r in sorted(results.items()):
        run.log({"eval/step": step, "eval/val_loss": r["val_loss"], "eval/perplexity": r["perplexity"]})
    run.finish()


if __name__ == "__main__":
    sys.exit(main())
