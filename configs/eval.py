"""eval.py's configuration: which checkpoints (or Hugging Face weights) to evaluate, on what, and how."""

from __future__ import annotations

import dataclasses
from typing import Annotated

from configs.base import MeshConfig
from fields import Checked, Field
from errors import ConfigError


@dataclasses.dataclass(frozen=True)
class EvalConfig(Checked):
    """Evaluation and sampling."""

    run_dir: Annotated[str | None, Field(
        "a training run directory (with checkpoints/): a local path or gs://bucket/path")] = None
    hf: Annotated[str | None, Field(
        "instead of a run: a Hugging Face GPT-2 directory (config.json + safetensors), or hub:NAME for a hub model"
        " (where the network allows)")] = None
    step: Annotated[int | None, Field("the checkpoint to evaluate (default: the latest)", ge=0)] = None
    all: Annotated[bool, Field("evaluate every checkpoint in the run")] = False
    batches: Annotated[int | None, Field(
        "validation batches to average (default: the whole validation split)", ge=1)] = None
    batch_size: Annotated[int, Field("sequences per batch (global)", ge=1)] = 8
    seq_len: Annotated[int | None, Field(
        "tokens per sequence (default: the run's train.seq_len; HF: 1024 or the model's context; with --tasks: the"
        " longest row lm-eval's requests are cut to, default the model's context)", ge=1)] = None
    dataset: Annotated[str | None, Field("corpus to evaluate on (default: the run's; required with --hf)")] = None
    prompt: Annotated[str | None, Field(
        "sample a continuation of this text: alone, with no validation pass (a run's checkpoints); with --batches"
        " N (or --tasks), after evaluating")] = None
    max_new_tokens: Annotated[int, Field(
        "tokens to sample (past the model's context each is sampled from the last block_size tokens, as nanoGPT"
        " does)", ge=1)] = 100
    temperature: Annotated[float, Field("sampling temperature (0: greedy)", ge=0)] = 0.8
    top_k: Annotated[int | None, Field("sample among the k most likely tokens only", ge=1)] = 200
    seed: Annotated[int, Field("sampling seed", ge=0)] = 0
    out: Annotated[str | None, Field(
        "results JSON (default: <run_dir>/eval.json; required with --hf)")] = None
    wandb: Annotated[bool, Field("also log to the training run's wandb run, in the mode the run used")] = True
    tasks: Annotated[str | None, Field(
        "instead of the validation loss: lm-evaluation-harness tasks, comma-separated (e.g."
        " hellaswag,lambada_openai; needs the eval extra, and a network for the hub's data sets)")] = None
    include_path: Annotated[str | None, Field("a directory of extra lm-eval task YAMLs (with --tasks)")] = None
    limit: Annotated[int | None, Field("lm-eval documents per task (default: all)", ge=1)] = None
    mesh: MeshConfig = MeshConfig(rules="fsdp")  # the device mesh to evaluate on (independent of training's)

    @property
    def validates(self) -> bool:
        """Whether this invocation evaluates (the validation loss or lm-eval tasks), not only samples: a prompt
        alone only samples, unless --batches asks for the loss too, or the weights are Hugging Face's."""
        return self.prompt is None or self.batches is not None or self.tasks is not None or self.hf is not None

    def cross_check(self) -> None:
        if (self.run_dir is None) == (self.hf is None):
            raise ConfigError("give exactly one of --run_dir (a training run) or --hf (Hugging Face weights)")
        if self.hf and ((self.dataset is None and not self.tasks) or self.out is None):
            raise ConfigError("--hf needs --dataset (a prepared corpus; not with --tasks) and --out (where its"
                              " results go)")
        if self.all and self.step is not None:
            raise ConfigError("give --step or --all, not both")
