"""Train GPT-2.

    python train.py                                   # the default: shakespeare_cpu
    python train.py --config gpt2_124m --data.dataset=/data/owt --train.batch_size=256
    python train.py --help                            # every field, with its meaning

Starting on a run directory that holds checkpoints resumes from the latest complete one, exactly.
Run the same command on every host of a TPU pod.
"""

from __future__ import annotations

import sys

import configs
from configs.base import Config
from configs.cli import parse
from errors import one_line_errors
from trainer.malloc import keep_freed_memory
from trainer.perf import libtpu_env
from trainer.perf.aot import run_aot
from trainer.perf.planner import DEFAULT_BUDGET_S, run_plan
from trainer.run import init_from
from trainer.run.driver import train


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    keep_freed_memory()  # before JAX starts its threads: see trainer/malloc.py
    libtpu_env.configure()  # before JAX starts its backends: libtpu's flags on a TPU, quiet without one
    argv = sys.argv[1:] if argv is None else argv
    name, argv = pop_option(argv, "--config")
    topology, argv = pop_option(argv, "--aot")
    plan_topology, argv = pop_option(argv, "--plan")
    budget, argv = pop_option(argv, "--plan_budget")
    verbose = bool(topology or plan_topology) and "--verbose" in argv
    argv = [a for a in argv if not (verbose and a == "--verbose")]
    cfg = parse(Config, argv, default=configs.load(name or configs.DEFAULT), prog="train.py", description=usage())
    cfg = init_from.resolve(cfg, argv)  # --init_from: the architecture of the HF checkpoint
    if topology:
        return run_aot(cfg, topology, name or configs.DEFAULT, verbose)
    if plan_topology:
        return run_plan(name or configs.DEFAULT, cfg, plan_topology, budget)
    return train(cfg)


def usage() -> str:
    return (f"{__doc__}\nBefore the config fields below:\n"
            f"  --config NAME     the preset the other flags override: {', '.join(configs.PRESETS)}"
            f" (default {configs.DEFAULT})\n"
            "  --aot TOPOLOGY    compile the real train call for a TPU topology (v4, v5e, v5p, v6e; e.g. v5e:2x4)"
            " and report its memory and predicted step time, instead of training (needs the `tpu` extra); TOPOLOGY*N:"
            " N slices joined by DCN, e.g. v5e:16x16*2\n"
            "  --plan TOPOLOGY   compile the preset's candidate layouts, micro-batches, remat policies, scan/unrolled"
            " layers and attention kernels for a TPU topology and rank them by predicted step time\n"
            f"  --plan_budget S   stop starting --plan's compiles after S seconds (default {DEFAULT_BUDGET_S:.0f})\n"
            "  --verbose         with --aot or --plan: also XLA's and libtpu's own figures for the compiled program\n")


def pop_option(argv: list[str], flag: str) -> tuple[str | None, list[str]]:
    """Takes `flag VALUE` / `flag=VALUE` out of argv. `--config NAME` picks the preset the other flags
    override; `--aot TOPOLOGY` compiles for a TPU topology instead of training, `--plan TOPOLOGY` searches
    candidate settings for one."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1], argv[:i] + argv[i + 2:]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1], argv[:i] + argv[i + 1:]
    return None, argv


if __name__ == "__main__":
    sys.exit(main())
