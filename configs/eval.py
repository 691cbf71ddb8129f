"""eval.py's configuration: which checkpoints (or Hugging Face weights) to evaluate, on what, and how."""

from __future__ import annotations

import dataclasses

from configs.base import MeshConfig


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Evaluation and sampling.

    Attributes:
      run_dir: a training run directory (with checkpoints/): a local path or gs://bucket/path.
      hf: instead of a run: a Hugging Face GPT-2 directory (config.json + safetensors), or `hub:NAME` for a
        hub model (where the network allows).
      step: the checkpoint to evaluate (default: the latest).
      all: evaluate every checkpoint in the run.
      batches: validation batches to average (>= 1; default: the whole validation split).
      batch_size: sequences per batch (global, >= 1).
      seq_len: tokens per sequence (>= 1; default: the run's train.seq_len; HF: 1024 or the model's context;
        with --tasks: the longest row lm-eval's requests are cut to, default the model's context).
      dataset: corpus to evaluate on (default: the run's; required with --hf).
      prompt: sample a continuation of this text after evaluating.
      max_new_tokens: tokens to sample (>= 1; past the model's context each is sampled from the last
        block_size tokens, as nanoGPT does).
      temperature: sampling temperature (finite, >= 0; 0: greedy).
      top_k: sample among the k most likely tokens only (>= 1).
      seed: sampling seed (>= 0).
      out: results JSON (default: <run_dir>/eval.json; required with --hf).
      tasks: instead of the validation loss: lm-evaluation-harness tasks, comma-separated (e.g.
        hellaswag,lambada_openai; needs the `eval` extra, and a network for the hub's data sets).
      include_path: a directory of extra lm-eval task YAMLs (with --tasks).
      limit: lm-eval documents per task (>= 1; default: all).
      wandb: also log to the training run's wandb run, in the mode the run used.
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
    tasks: str | None = None
    include_path: str | None = None
    limit: int | None = None
    mesh: MeshConfig = MeshConfig(rules="fsdp")
