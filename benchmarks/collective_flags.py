"""What each libtpu flag train.py sets (trainer/libtpu_env.py) does to a preset's compiled program: the train
call compiled for a topology with all of the generation's flags, with none, and with each flag turned the other
way while the rest stay set; per compile the predicted step and the collectives' hidden and exposed time
(planning/step_time.py). Predicted from the compiled programs, not measured.

    python -m benchmarks.collective_flags --config gpt2_124m --topology v5e:2x4 --json flags.json
    python -m benchmarks.collective_flags --config gpt2_xl_pod --topology v5e:16x16 --by-group   # 4 compiles

Each compile is one lowering compiled under other compiler options: minutes per option for the larger presets
on a 2-core machine (not kept in the compile store: only the figures are needed).
"""

from __future__ import annotations

import argparse
import json

import jax

import configs
from configs.base import Config
from configs.cli import parse
from trainer import libtpu_env
from planning.aot import chip_of, topology_mesh
from planning.step_time import estimate_hlo, torus
from trainer.program.train_program import TrainProgram


def opposite(value: str) -> str | None:
    """The other value of a boolean flag; None for a flag that is not one (a size)."""
    return {"true": "false", "false": "true"}.get(value)


def flipped(flags: dict[str, str], names) -> dict[str, str]:
    """`flags` with each of `names` turned the other way (a boolean) or left to libtpu's default (a size)."""
    out = {k: v for k, v in flags.items() if k not in names or opposite(v)}
    return {**out, **{k: opposite(flags[k]) for k in names if opposite(flags[k])}}


def variants(generation: str, by_group: bool = False) -> list[tuple[str, dict[str, str]]]:
    """(label, compiler options): every flag, none, then each boolean flag (or, `by_group`, each of MaxText's
    groups of flags) flipped with the others kept."""
    flags = libtpu_env.COLLECTIVE_FLAGS[generation].flags
    out = [("all flags", dict(flags)), ("no flags (libtpu's defaults)", {})]
    if by_group:
        return out + [(f"{group} flipped", flipped(flags, members))
                      for group, members in libtpu_env.GROUPS.items() if set(members) <= set(flags)]
    for name, value in flags.items():
        other = opposite(value)
        out.append((f"{name}={other}" if other else f"without {name}", flipped(flags, [name])))
    return out


def measure(cfg: Config, topology: str, by_group: bool = False) -> list[dict]:
    generation, chip = chip_of(topology)
    cfg, mesh = topology_mesh(cfg, topology)
    program = TrainProgram.build(cfg, mesh)
    with jax.set_mesh(mesh):
        lowered = program.lower()
        rows = []
        for label, options in variants(generation, by_group):
            e = estimate_hlo(lowered.compile(compiler_options=options).as_text(), chip, dict(mesh.shape),
                             steps_per_call=cfg.train.steps_per_call, torus=torus(mesh))
            rows.append({"variant": label, "step_ms": e.predicted_s * 1e3, "collective_ms": e.collective_s * 1e3,
                         "hidden_ms": (e.collective_s - e.exposed_s) * 1e3, "exposed_ms": e.exposed_s * 1e3})
            print(f"{label:70s} step {rows[-1]['step_ms']:8.1f} ms  collectives {rows[-1]['collective_ms']:7.1f} ms:"
                  f" {rows[-1]['hidden_ms']:7.1f} hidden, {rows[-1]['exposed_ms']:7.1f} exposed", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    libtpu_env.configure()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, choices=configs.PRESETS)
    p.add_argument("--topology", required=True)
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--by-group", action="store_true", help="flip MaxText's groups of flags, not each flag")
    args, overrides = p.parse_known_args(argv)
    cfg = parse(Config, overrides, default=configs.load(args.config), prog="collective_flags")
    rows = measure(cfg, args.topology, args.by_group)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
