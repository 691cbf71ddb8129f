"""Whether a compiled program fits the memory it will run in, before it runs: the planner's check for a TPU
(plan.py), and the run's own on this host before its first call, so that a laptop's run that cannot fit ends in
one line instead of the kernel's OOM killer (which leaves nothing to read)."""

from __future__ import annotations

import jax

from errors import ConfigError

GIB = 2**30


def program_bytes(argument: int, output: int, alias: int, temp: int) -> int:
    """A program's bytes per device, from XLA's memory analysis: donated arguments alias outputs, counted once."""
    return argument + output - alias + temp


def available_bytes() -> int | None:
    """What this process can still allocate where its devices' buffers live: an accelerator's free memory, or on
    a CPU the host's available memory (Linux's MemAvailable, shared by every CPU device); None if unknown."""
    device = jax.local_devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        limit = stats.get("bytes_limit")
        return None if limit is None else limit - stats.get("bytes_in_use", 0)
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):  # not Linux
        return None


def check_fits(compiled, cfg) -> None:
    """Refuses the run before its first call when the train call's buffers beyond its arguments (already
    allocated: the state, the batches) exceed what the devices have left, naming the flags that shrink them."""
    available = available_bytes()
    if available is None:
        return
    m = compiled.memory_analysis()
    per_device = program_bytes(0, m.output_size_in_bytes, m.alias_size_in_bytes, m.temp_size_in_bytes)
    shared = jax.local_devices()[0].platform == "cpu"  # the CPU devices of a process share its memory
    needed = per_device * (jax.local_device_count() if shared else 1)
    if needed > available:
        t, where = cfg.train, "this machine" if shared else "a device"
        raise ConfigError(
            f"the train call needs {needed / GIB:.1f} GiB more memory than its state, but {where} has"
            f" {available / GIB:.1f} GiB free: lower --train.batch_size (now {t.batch_size}) or raise"
            f" --train.grad_accum (now {t.grad_accum}), or --model.remat=full, --model.dtype=bfloat16"
            ' (docs/training.md, "Presets on a laptop")')
