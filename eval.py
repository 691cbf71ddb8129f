"""Evaluate and sample from saved checkpoints (or Hugging Face GPT-2 weights).

    python eval.py --run_dir runs/shakespeare_cpu                 # latest checkpoint, whole val split
    python eval.py --run_dir runs/shakespeare_cpu --all           # every checkpoint in the run
    python eval.py --run_dir runs/shakespeare_cpu --step 400 --batches 20 --prompt "ROMEO:"
    python eval.py --hf /path/to/hf-gpt2 --dataset /data/owt --out results.json   # HF weights
    python eval.py --run_dir runs/shakespeare_cpu --tasks hellaswag,lambada_openai  # lm-evaluation-harness

Checkpoints restore onto whatever devices this machine has (any device count or mesh); one jitted loss call
serves every checkpoint. Results are merged into <run_dir>/eval.json (keyed by step, dataset, seq_len,
batch size and number of batches) and, when the run used wandb, logged to the same wandb run as `eval/*`.
"""

from __future__ import annotations

import sys

from configs.cli import parse
from configs.eval import EvalConfig
from errors import one_line_errors
from trainer import libtpu_env
from trainer.eval.driver import evaluate
from trainer.malloc import keep_freed_memory


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    keep_freed_memory()  # before JAX starts its threads: see trainer/malloc.py
    libtpu_env.configure()  # before JAX starts its backends: libtpu's flags on a TPU, quiet without one
    return evaluate(parse(EvalConfig, argv, prog="eval.py", description=__doc__))


if __name__ == "__main__":
    sys.exit(main())
