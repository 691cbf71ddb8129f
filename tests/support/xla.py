"""The XLA flags of the suite's processes: `devices` fake CPU devices, written in one place.

Quicker CPU code generation was measured and is not used (docs/testing.md): at LLVM optimization level 0 the code runs
~3x slower and the suite took as long; at level 1 it is quicker (pytest 15 min 5 s instead of 17 min 14 s on a fresh
clone) but two programs the tests require to be bitwise equal then differ in the last bit, which they do not with
XLA's defaults — the defaults users run.
"""


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test process with `devices` fake CPU devices."""
    return f"--xla_force_host_platform_device_count={devices}"
