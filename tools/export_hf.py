"""Export a checkpoint of a training run as a Hugging Face GPT-2 directory, tokenizer included.

    python -m tools.export_hf --run_dir runs/shakespeare_cpu --out runs/shakespeare_cpu/hf             # latest
    python -m tools.export_hf --run_dir runs/shakespeare_cpu --step 400 --out exports/shakespeare-400

The directory holds `config.json` + `model.safetensors` (gpt2/hf.py) and `tokenizer.json` +
`tokenizer_config.json` (data/tokenizer.py, encoding exactly as training's tiktoken tokenizer), so
`GPT2LMHeadModel.from_pretrained`, `AutoTokenizer.from_pretrained` and `pipeline("text-generation", ...)` load it
offline; `train.py --init_from` and `eval.py --hf` read it back. Needs the `hf` extra. Runs as one process; the
parameters are restored onto one device of this machine (any device count or mesh the run trained on).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Annotated

import jax

from configs.base import CheckpointConfig
from configs.cli import parse
from fields import Checked, Field
from data.tokenizer import VOCAB_SIZE, save_hf_tokenizer
from errors import CheckpointError, ConfigError, one_line_errors
from gpt2.hf import require_standard, to_hf
from gpt2.sharding import ShardingRules
from trainer.program.layout import ModelLayout
from trainer.program.mesh import make_mesh
from trainer.storage.checkpoints import Checkpoints, config_from_meta
from trainer.storage.files import storage_errors
from trainer.storage.run_dir import RunDir
from trainer.telemetry.library_logs import library_logs_to


@dataclasses.dataclass(frozen=True)
class ExportConfig(Checked):
    """Export a checkpoint to Hugging Face format."""

    run_dir: Annotated[str, Field("a training run directory (with checkpoints/)")]
    out: Annotated[str, Field("the directory to write (must not exist yet, or be empty)")]
    step: Annotated[int | None, Field("the checkpoint to export (default: the latest)", ge=0)] = None


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    cfg = parse(ExportConfig, argv, prog="python -m tools.export_hf", description=__doc__)
    export(cfg.run_dir, cfg.out, step=cfg.step)
    return 0


def export(run_dir: str, out: str, *, step: int | None = None) -> Path:
    """Writes checkpoint `step` (default: the latest) of `run_dir` to `out`; returns `out`."""
    if "://" in out:
        raise ConfigError(f"--out {out}: export writes to a local directory; copy it to the bucket afterwards")
    out_dir = Path(out)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConfigError(f"--out {out_dir}: exists and is not an empty directory; choose a new one")
    if step is not None and step < 0:
        raise ConfigError(f"--step must be >= 0, got {step}")
    try:
        import transformers  # noqa: F401 - the `hf` extra: the tokenizer files are written by transformers
    except ImportError:
        raise ConfigError("export needs the `hf` extra: pip install -e '.[hf]'") from None

    with library_logs_to(RunDir(run_dir) / "logs"):  # Orbax's notes on read-only checkpoints
        ckpt = Checkpoints(run_dir, CheckpointConfig(), read_only=True)
        steps = ckpt.all_steps() if ckpt.directory.exists() else []
        if not steps:
            raise CheckpointError(f"{ckpt.directory}: no checkpoints to export")
        if step is not None and step not in steps:
            raise CheckpointError(f"{ckpt.directory}: no checkpoint at step {step}; steps: {steps}")
        step = steps[-1] if step is None else step
        model_config = config_from_meta(ckpt.read_meta(step), ckpt.path(step)).model
        require_standard(model_config, str(ckpt.path(step)))  # before any restore
        if model_config.vocab_size != VOCAB_SIZE:
            raise ConfigError(f"{ckpt.path(step)}: model.vocab_size={model_config.vocab_size} is not GPT-2's"
                              f" {VOCAB_SIZE}; the GPT-2 tokenizer files would not fit it")
        # one device: to_hf gathers every parameter to the host anyway
        layout = ModelLayout.build(model_config, make_mesh(devices=jax.devices()[:1]), ShardingRules.preset("dp"))
        with jax.set_mesh(layout.mesh):
            params = ckpt.restore_params(step, layout.abstract_params)
        ckpt.close()
    with storage_errors("write", out_dir):
        to_hf(layout.model(params), out_dir)
        save_hf_tokenizer(out_dir, model_max_length=model_config.block_size)
    print(f"exported {ckpt.path(step)} to {out_dir} (config.json, model.safetensors, tokenizer.json,"
          " tokenizer_config.json)")
    return out_dir


if __name__ == "__main__":
    sys.exit(main())
