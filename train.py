"""Train GPT-2.

    python train.py                                   # the default: shakespeare_cpu
    python train.py --config gpt2_124m --data.dataset=/data/owt --train.batch_size=256
    python train.py --help                            # every field, with its meaning

Starting on a run directory that holds checkpoints resumes from the latest complete one, exactly.
Run the same command on every host of a TPU pod. Before renting one, `python plan.py` compiles this run for the
pod's topology here and predicts its memory and step time.
"""

from __future__ import annotations

import sys

from configs.base import Config
from configs.cli import parse
from errors import one_line_errors
from trainer import libtpu_env
from trainer.malloc import keep_freed_memory
from trainer.run import init_from
from trainer.run.driver import train


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    keep_freed_memory()  # before JAX starts its threads: see trainer/malloc.py
    libtpu_env.configure()  # before JAX starts its backends: libtpu's flags on a TPU, quiet without one
    cfg = parse(Config, argv, presets=True, prog="train.py", description=__doc__)
    return train(init_from.resolve(cfg, sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
