"""TPU compiles kept on disk: what the reports need of a compiled program (its optimized HLO text, memory and cost
analyses), keyed by the lowered program and everything else that changes the compile.

An AOT compile of a train call takes from a minute (gpt2_124m on v5e:2x4) to ten (gpt2-xl on v5e:16x16) on a
2-core machine, and JAX's persistent compilation cache cannot keep them (a compile-only TPU client's executables
are not serializable). The step-time model reads only the HLO text, so a re-run of `plan.py` — after a
change to the cost model, or a search that revisits a candidate — estimates again in seconds from the stored
text. A refusal (the program does not fit) is kept too: the compiler's message is the result.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import importlib.metadata
import json
import os

import jax
from etils import epath

from trainer.storage.files import atomic_write

STORE = "~/.cache/gpt2_nnx/aot"
# what else changes a compile besides the lowered program and its compiler options: the libraries, and the flags
# libtpu and XLA read from the environment
_ENVIRONMENT = ("LIBTPU_INIT_ARGS", "XLA_FLAGS")


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
    """A TPU compile's results, or the compiler's refusal (`error`, e.g. RESOURCE_EXHAUSTED's message)."""

    hlo: str = ""  # compiled.as_text(): the optimized, scheduled module
    argument_bytes: int = 0
    output_bytes: int = 0
    temp_bytes: int = 0
    alias_bytes: int = 0
    flops: float = 0.0  # XLA's cost analysis (a loop body counted once)
    optimal_seconds: float = -1.0  # libtpu's cost model for the whole program
    error: str | None = None
    from_store: bool = False  # read back, not compiled now


def compile_lowered(lowered, topology: str, options: dict[str, str] | None = None,
                    text: str | None = None) -> CompiledProgram:
    """`lowered.compile(compiler_options=options)`'s results for `topology`, from the store when this exact
    compile was made before. `options`: the libtpu flags of this compile (trainer/libtpu_env.py); `text`:
    `lowered.as_text()` where the caller has it already."""
    options = options or {}
    path = stored_path(lowered, topology, options, text)
    if path.exists():
        return dataclasses.replace(CompiledProgram(**json.loads(gzip.decompress(path.read_bytes()))), from_store=True)
    result = _compile(lowered, options)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, gzip.compress(json.dumps(dataclasses.asdict(result)).encode(), compresslevel=6))
    except OSError:
        pass  # an unwritable store only costs the compile next time
    return result


def stored_path(lowered, topology: str, options: dict[str, str], text: str | None = None) -> epath.Path:
    """Where this compile is kept (it exists once the compile was made)."""
    key = _key(text if text is not None else lowered.as_text(), topology, options)
    return epath.Path(os.path.expanduser(STORE)) / f"{key}.json.gz"


def _compile(lowered, options: dict[str, str]) -> CompiledProgram:
    try:
        compiled = lowered.compile(compiler_options=options)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return CompiledProgram(error=str(e).strip().splitlines()[0].split("RESOURCE_EXHAUSTED: ", 1)[-1])
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return CompiledProgram(hlo=compiled.as_text(), argument_bytes=mem.argument_size_in_bytes,
                           output_bytes=mem.output_size_in_bytes, temp_bytes=mem.temp_size_in_bytes,
                           alias_bytes=mem.alias_size_in_bytes, flops=float(cost.get("flops", 0.0)),
                           optimal_seconds=float(cost.get("optimal_seconds", -1.0)))


def _key(text: str, topology: str, options: dict[str, str]) -> str:
    versions = {name: _version(name) for name in ("jax", "jaxlib", "libtpu")}
    environment = {name: os.environ.get(name, "") for name in _ENVIRONMENT}
    identity = json.dumps({"topology": topology, "versions": versions, "environment": environment,
                           "options": options}, sort_keys=True)
    return hashlib.sha256(identity.encode() + text.encode()).hexdigest()[:32]


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"
