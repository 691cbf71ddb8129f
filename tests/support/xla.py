"""The XLA flags every process of the suite compiles with: fake CPU devices, and XLA's quicker CPU code generation.

The suite's time is mostly XLA compiling hundreds of small programs for the CPU. These two flags change only how the
CPU backend turns an optimized HLO program into machine code — LLVM at its first optimization level instead of its
default, the loop emitters instead of the MLIR fusion emitters — not the program: sharding, collectives, fusion
decisions and every op are the same, and a TPU compile for a topology is byte for byte the one it is without them.
Level 1, not 0: at level 0 the compiles are quicker still but the code runs several times slower, and the runs of a
few dozen steps lose more than the compiles gain (docs/testing.md has both measurements). The README's commands run
with a user's own defaults, none of these (tests/e2e/test_readme.py).
"""

QUICK_CPU_CODEGEN = ("--xla_backend_optimization_level=1", "--xla_cpu_use_fusion_emitters=false")


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test process with `devices` fake CPU devices."""
    return " ".join([f"--xla_force_host_platform_device_count={devices}", *QUICK_CPU_CODEGEN])
