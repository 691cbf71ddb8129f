"""Plan a TPU run from a machine without TPUs: compile the real train call for a topology and predict its memory and
step time, or search the preset's layouts for the fastest that fits.

    python plan.py --config gpt2_124m --topology v5e:2x4              # fits? per-chip memory, predicted step time
    python plan.py --config gpt2_124m --topology v5e:2x4 --search     # the preset's candidates, ranked
    python plan.py --config gpt2_xl_pod --topology 'v5e:16x16*2'      # two slices joined by DCN

Any training flag works as it does for train.py (`--train.batch_size=256`, `--model.remat=full`): what is compiled
is what train.py would run. Needs the `tpu` extra (libtpu compiles; nothing runs on a TPU). Figures are
predictions from the compiled program (docs/aot_planning.md).
"""

from __future__ import annotations

import sys

from configs.cli import parse, preset_name
from configs.plan import PlanConfig
from errors import one_line_errors
from planning.aot import run_aot
from planning.planner import run_plan
from trainer import libtpu_env
from trainer.malloc import keep_freed_memory
from trainer.run import init_from


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    keep_freed_memory()  # before JAX starts its threads: see trainer/malloc.py
    libtpu_env.configure()  # before JAX starts its backends: libtpu quiet without a TPU, its flags on one
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse(PlanConfig, argv, presets=True, prog="plan.py", description=__doc__)
    cfg = init_from.resolve(cfg, argv)  # --init_from: its architecture
    preset = preset_name(argv)[0]
    return run_plan(cfg, preset) if cfg.search else run_aot(cfg.run, cfg.topology, preset, cfg.verbose)


if __name__ == "__main__":
    sys.exit(main())
