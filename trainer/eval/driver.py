"""An evaluation run from start to end (`eval.py`): the checks before any work, then the validation loss (or lm-eval
tasks) and samples of a run's checkpoints — the latest, one, or all — or of Hugging Face weights, merged into
eval.json and the run's wandb run.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from etils import epath
from flax import nnx

from configs.base import CheckpointConfig, Config, DataConfig, DistributedConfig, StorageConfig
from configs.eval import EvalConfig
from errors import CheckpointError, ConfigError, StorageError, warn
from gpt2.hf import config_from_hf, from_hf, hf_directory, read_hf_config
from gpt2.sharding import ShardingRules
from trainer.corpus import resolve_corpus, val_dataset
from trainer.eval.sampling import prompt_that_fits, sample
from trainer.eval.tasks import check_tasks
from trainer.processes import initialize_distributed, is_process_0, on_process_0, say
from trainer.program.evaluator import Evaluator
from trainer.program.mesh import checked_mesh
from trainer.storage.checkpoints import CheckpointGone, Checkpoints, check_compatible, config_from_meta
from trainer.storage.compile_cache import use_compile_cache
from trainer.storage.files import storage_errors
from trainer.storage.run_dir import RunDir, eval_record, merge_eval_results, open_run_dir
from trainer.telemetry.library_logs import library_logs_to
from trainer.telemetry.metrics import init_wandb, resolve_wandb_mode


def evaluate(cfg: EvalConfig) -> int:
    """eval.py: checks every argument, then evaluates the run's checkpoints or the HF weights; 0 when done."""
    check_args(cfg)
    if cfg.hf:
        return evaluate_hf(cfg)
    with library_logs_to(RunDir(cfg.run_dir) / "logs"):  # Orbax's notes on read-only restores, ...
        return evaluate_run(cfg)


def check_args(cfg: EvalConfig) -> None:
    """What the config cannot know, before any work: whether lm-eval and the tasks asked for are there."""
    if cfg.tasks is not None:
        check_tasks(cfg.tasks, cfg.include_path, ("--tasks", "--include_path"))


def evaluate_run(cfg: EvalConfig) -> int:
    run_dir = open_run_dir(cfg.run_dir, StorageConfig())  # a faltering cloud store: retried as training would
    ckpt = Checkpoints(cfg.run_dir, CheckpointConfig(), read_only=True)
    steps = ckpt.all_steps() if ckpt.directory.exists() else []
    if not steps:
        raise CheckpointError(f"{ckpt.directory}: no checkpoints to evaluate")
    if cfg.step is not None and cfg.step not in steps:
        raise CheckpointError(f"{ckpt.directory}: no checkpoint at step {cfg.step}; steps: {steps}")
    chosen = steps if cfg.all else [cfg.step if cfg.step is not None else steps[-1]]
    meta = newest_meta(ckpt, chosen, steps)
    run = config_from_meta(meta, ckpt.path(chosen[-1]))
    dataset = cfg.dataset or run.data.dataset
    initialize_distributed(DistributedConfig())
    use_compile_cache(run.train.compile_cache, run_dir, run.train.compile_cache_gb)
    out = cfg.out or str(run_dir / "eval.json")
    if cfg.validates:
        on_process_0(lambda: check_results_file(out), f"write the results to {out}")
    evaluator, corpus, seq_len = setup(cfg, run.model, dataclasses.replace(run.data, dataset=dataset),
                                       cfg.seq_len or run.train.seq_len)
    records, failed = [], []
    with jax.set_mesh(evaluator.layout.mesh):
        for step in chosen:
            try:
                check_compatible(ckpt.read_meta(step), run, ckpt.path(step))
                params = ckpt.restore_params(step, evaluator.layout.abstract_params)
                if not evaluator.params_finite(params):
                    raise CheckpointError(f"{ckpt.path(step)}: its parameters are not finite (saved by a run"
                                          " that diverged); evaluate an earlier checkpoint")
                if cfg.validates:
                    records.append(evaluate_params(cfg, evaluator, params, corpus, seq_len, step=step,
                                                   dataset=dataset))
            except CheckpointError as e:
                if not cfg.all:
                    raise CheckpointError(f"{e}; checkpoints in this run: {ckpt.all_steps()}") from None
                warn(f"{e}; skipped (checkpoints in this run now: {ckpt.all_steps()})")
                if not isinstance(e, CheckpointGone):
                    failed.append(step)
                continue
            maybe_sample(cfg, evaluator.layout.model(params))
    ckpt.close()
    log_to_wandb(cfg, run, meta, records)  # first: wandb's own lines, then where the results are
    finish(records, out=out)
    if failed:
        raise CheckpointError(f"{len(failed)} of {len(chosen)} checkpoints could not be evaluated (steps {failed});"
                              " the others' results are saved")
    return 0


def newest_meta(ckpt: Checkpoints, chosen: list[int], steps: list[int]) -> dict:
    """The metadata of the newest chosen checkpoint that has readable metadata."""
    for step in reversed(chosen):
        try:
            return ckpt.read_meta(step)
        except CheckpointError as e:
            if len(chosen) == 1:
                raise CheckpointError(f"{e}; checkpoints in this run: {steps}") from None
            warn(f"{e}; skipped")
    raise CheckpointError(f"{ckpt.directory}: no checkpoint with readable metadata among steps {chosen}")


def evaluate_hf(cfg: EvalConfig) -> int:
    directory = hf_directory(cfg.hf)
    model_config = config_from_hf(read_hf_config(directory))
    seq_len = cfg.seq_len or min(1024, model_config.block_size)
    initialize_distributed(DistributedConfig())
    on_process_0(lambda: check_results_file(cfg.out), f"write the results to {cfg.out}")
    data = None if cfg.tasks else DataConfig(dataset=cfg.dataset)  # lm-eval tasks bring their own documents
    evaluator, corpus, seq_len = setup(cfg, model_config, data, seq_len)
    layout = evaluator.layout
    with jax.set_mesh(layout.mesh):
        model = from_hf(directory, mesh=layout.mesh, rules=layout.rules)
        record = evaluate_params(cfg, evaluator, nnx.state(model, nnx.Param), corpus, seq_len, step=None,
                          dataset=cfg.dataset, model=str(cfg.hf))
        maybe_sample(cfg, model)
    finish([record], out=cfg.out)
    return 0


def setup(cfg: EvalConfig, model_config, data: DataConfig | None, seq_len: int):
    """(evaluator, corpus or None, seq_len) on this machine's devices; the prompt is checked before any work."""
    if seq_len > model_config.block_size:
        raise ConfigError(f"--seq_len={seq_len} exceeds the model's context of {model_config.block_size}")
    if cfg.prompt is not None:
        prompt_ids(cfg, model_config.block_size)
    mesh = checked_mesh(cfg.mesh, cfg.batch_size, batch_flag=f"--batch_size={cfg.batch_size}")
    evaluator = Evaluator.build(model_config, mesh, ShardingRules.preset(cfg.mesh.rules))
    needed = cfg.validates and not cfg.tasks  # the validation loss reads the corpus; tasks and samples do not
    corpus = resolve_corpus(data, vocab_size=model_config.vocab_size, seq_len=seq_len) if needed else None
    return evaluator, corpus, seq_len


def evaluate_params(cfg: EvalConfig, evaluator: Evaluator, params, corpus, seq_len: int, **key) -> dict:
    """One result record: the key (step or model, and the settings that change the number) and the figures."""
    if cfg.tasks:  # lm-eval's figures instead of the validation loss; the context is the model's
        from trainer.eval.harness import evaluate_tasks  # lm-eval: the optional `eval` extra (checked at start)

        return evaluate_tasks(evaluator, params, tasks=cfg.tasks, include_path=cfg.include_path, limit=cfg.limit,
                              batch_size=cfg.batch_size, max_length=cfg.seq_len or evaluator.layout.model_config.block_size,
                              **{k: v for k, v in key.items() if k != "dataset"})
    batches = val_dataset(corpus, vocab_size=evaluator.layout.model_config.vocab_size, seq_len=seq_len,
                          batch_size=cfg.batch_size, num_epochs=1)
    loss, n = evaluator.mean_loss(params, batches, cfg.batches)
    where = f"step {key['step']}" if key.get("step") is not None else "model"
    if n == 0:
        raise ConfigError(f"{corpus.directory}: the validation split holds fewer than --batch_size={cfg.batch_size}"
                          f" windows of --seq_len={seq_len} tokens; lower them")
    if not math.isfinite(loss):
        raise CheckpointError(f"{where}: validation loss is {loss}: the model's numbers overflow; evaluate an"
                              " earlier checkpoint")
    settings = {**key, "seq_len": seq_len, "batch_size": cfg.batch_size, "batches": cfg.batches or "all"}
    record = eval_record(settings, val_loss=loss, perplexity=math.exp(loss), batches_evaluated=n,
                         tokens=n * cfg.batch_size * seq_len)
    say(f"{where}: val_loss {loss:.4f}  perplexity {record['perplexity']:.2f}  ({n} batches,"
        f" {record['tokens']:,} tokens)")
    return record


def maybe_sample(cfg: EvalConfig, model) -> None:
    if cfg.prompt is None:
        return
    text = sample(model, prompt_ids(cfg, model.config.block_size), cfg.max_new_tokens, seed=cfg.seed,
                  temperature=cfg.temperature, top_k=cfg.top_k)  # every process takes part
    say(text)


def prompt_ids(cfg: EvalConfig, block_size: int) -> list[int]:
    return prompt_that_fits(cfg.prompt, block_size, prompt_flag="--prompt",
                            context=f"the model's context of {block_size}")


def check_results_file(out: str) -> None:
    """Before any work: `out` is an eval.json that eval.py wrote (not a foreign or corrupt file) or absent, in a
    place this process can write (a read-only run directory needs --out elsewhere)."""
    path = epath.Path(out)
    try:
        RunDir(path.parent).check_writable(for_file=path.name)
    except StorageError as e:
        raise StorageError(f"{e}; pass --out to write the results elsewhere") from None
    with storage_errors("read", path):
        found = path.exists()
    if found:
        merge_eval_results(path, [])  # reads and checks it, and writes its results back unchanged


def finish(records: list[dict], *, out: str) -> None:
    if is_process_0() and records:
        merge_eval_results(out, records)
        print(f"results: {out}")


def log_to_wandb(cfg: EvalConfig, run: Config, meta: dict, records: list[dict]) -> None:
    """Adds `eval/*` metrics to the training run, keyed by the checkpoint step, in the run's own wandb mode
    (a run trained offline stays offline, whatever credentials this machine has)."""
    if not (cfg.wandb and records and meta.get("wandb_id")) or not is_process_0():
        return
    mode = meta.get("wandb_mode") or resolve_wandb_mode(run.log.wandb)
    wandb_run = init_wandb(RunDir(cfg.run_dir), mode, project=run.log.project,
                           name=run.log.run_name or RunDir(cfg.run_dir).path.name, run_id=meta["wandb_id"])
    if wandb_run is None:
        return
    wandb_run.define_metric("eval/step")
    wandb_run.define_metric("eval/*", step_metric="eval/step")
    for r in sorted(records, key=lambda r: r["step"]):
        figures = {f"{task}/{name}": value for task, metrics in r.get("lm_eval", {}).items()
                   for name, value in metrics.items()}
        figures.update({k: r[k] for k in ("val_loss", "perplexity") if k in r})
        wandb_run.log({"eval/step": r["step"], **{f"eval/{k}": v for k, v in figures.items()}})
    wandb_run.finish()
