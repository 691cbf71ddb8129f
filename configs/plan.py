"""plan.py's configuration: a training run's config (any preset, any override) plus what to compile it for."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import tyro

from configs.base import Config
from fields import Field


@dataclasses.dataclass(frozen=True)
class PlanConfig(Config):
    """A training run compiled for a TPU topology instead of trained: its memory and predicted step time, or a
    search over its layout."""

    topology: Annotated[str, Field(
        "the TPU slice to compile for, as libtpu names it: GENERATION:SHAPE (v4, v5e, v5p, v6e; e.g. v5e:2x4,"
        " v5p:4x4x4); TOPOLOGY*N: N slices joined by the data-center network, e.g. v5e:16x16*2")] = tyro.MISSING
    search: Annotated[bool, Field(
        "compile the preset's candidate layouts, micro-batches, remat policies, scanned/unrolled layers and"
        " attention kernels, and rank them by predicted step time (instead of compiling the run as"
        " configured)")] = False
    # 10 minutes: what a first plan is worth waiting for; 3-5 compiles of gpt2_124m on a 2-core machine. Compiles
    # are kept, so the same command run again goes on from where the budget stopped it
    budget: Annotated[float, Field(
        "with --search, stop starting compiles after this many seconds (a compile under way finishes; a re-run"
        " reads the compiles made back and goes on)", gt=0)] = 600.0
    verbose: Annotated[bool, Field(
        "also print XLA's and libtpu's own figures for the compiled program (its FLOP count, libtpu's cost"
        " model)")] = False

    @property
    def run(self) -> Config:
        """The training run's own config (without plan.py's fields)."""
        return Config(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Config)})
