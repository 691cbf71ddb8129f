"""Starting a run from Hugging Face GPT-2 weights: `train.py --init_from DIR` (or `hub:NAME`).

The architecture is the checkpoint's: its config.json sets the fields it describes (`ARCHITECTURE`) and the
run's config keeps the others (dtype, scan, remat, vocabulary padding, dropout, ...); a `--model.*` flag that
contradicts the checkpoint is refused. The weights are read only for a fresh run, straight into the trainer's
parameter shardings; a run directory that holds checkpoints resumes from its own, like any other run.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from configs.base import Config
from errors import CheckpointError, ConfigError
from gpt2.hf import HFCheckpointError, config_from_hf, from_hf, hf_directory, read_hf_config
from trainer.program.layout import ModelLayout

# the GPT2Config fields a Hugging Face config.json describes (gpt2/hf.py: config_from_hf)
ARCHITECTURE = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "layer_norm_epsilon")


def resolve(cfg: Config, argv: list[str]) -> Config:
    """`cfg` with the architecture of `cfg.init_from`'s config.json (unchanged without --init_from).

    argv tells which `--model.*` fields the user set: those must agree with the checkpoint; the preset's own
    model fields are simply replaced.
    """
    if cfg.init_from is None:
        return cfg
    try:
        hf = config_from_hf(read_hf_config(hf_directory(cfg.init_from)))
    except HFCheckpointError as e:
        raise ConfigError(f"--init_from: {e}") from None
    given = model_flags(argv)
    conflicts = [f"--model.{name}={getattr(cfg.model, name)} (the checkpoint has {getattr(hf, name)})"
                 for name in ARCHITECTURE if name in given and getattr(cfg.model, name) != getattr(hf, name)]
    if conflicts:
        raise ConfigError(f"--init_from {cfg.init_from} sets the architecture, and {', '.join(conflicts)}"
                          " contradicts it; drop the flag")
    model = dataclasses.replace(cfg.model, **{name: getattr(hf, name) for name in ARCHITECTURE})
    return dataclasses.replace(cfg, model=model)  # validates again: train.seq_len must fit the new context


def load_params(cfg: Config, layout: ModelLayout) -> nnx.State | None:
    """The weights of `cfg.init_from` in the layout's parameter shardings, each process reading only the
    regions of the files its devices hold (gpt2/hf.py: the files are memory-mapped); None without --init_from."""
    if cfg.init_from is None:
        return None
    others = {f.name: getattr(cfg.model, f.name) for f in dataclasses.fields(cfg.model) if f.name not in ARCHITECTURE}
    try:
        model = from_hf(cfg.init_from, mesh=layout.mesh, rules=layout.rules, **others)
    except HFCheckpointError as e:
        raise CheckpointError(f"--init_from: {e}") from None
    assert model.config == cfg.model, (model.config, cfg.model)
    # the same layouts; device_put only relabels them as the train call was compiled for (no data moves)
    return jax.device_put(nnx.state(model, nnx.Param), layout.param_shardings)


def model_flags(argv: list[str]) -> set[str]:
    """The `--model.<field>` names given on the command line (`--model.n_layer=6`, `--model.n-layer 6`)."""
    keys = (arg[2:].split("=", 1)[0].replace("-", "_") for arg in argv if arg.startswith("--"))
    return {key.removeprefix("model.") for key in keys if key.startswith("model.")}
