"""The environment libtpu reads, in one place: the compiler flags TPU teams ship for each generation, and the
settings that keep libtpu quiet on a machine without a TPU.

Entry points call `configure()` once, before JAX initializes its backends (before the first `jax.devices()`,
`jax.distributed.initialize` or compile):

- on a TPU VM it sets LIBTPU_INIT_ARGS to the chip generation's COLLECTIVE_FLAGS, unless the user set
  LIBTPU_INIT_ARGS (theirs are used as they are);
- on a machine without a TPU, where JAX still loads libtpu when the `tpu` extra is installed (to look for chips,
  or to compile for a topology with plan.py), it tells libtpu that it runs on one host of its own.
  Without that, libtpu asks the cloud metadata server for the TPU's worker hostnames and accelerator type,
  finds placeholders ("WARNING: could not determine ...") and logs three false errors before JAX falls back to
  the CPU (`Failed to find host bounds ...`, `E0000 ... INVALID_ARGUMENT: Error: unexpected worker hostname`,
  `=== Source Location Trace: ===`). libtpu's log levels (TPU_STDERR_LOG_LEVEL, TPU_MIN_LOG_LEVEL) do not hide
  them: they are written before libtpu's logging starts. With TPU_WORKER_HOSTNAMES and TPU_HOST_BOUNDS set
  nothing is written, and a compile for a topology is the same program (tests/unit/test_libtpu_env.py and
  tests/e2e/test_aot.py check both).

plan.py compiles with the flags of the generation it compiles for (`compile_options`), passed to the compiler per
compile — one process may compile for several generations (planning/backtest.py) — and the compile store's key
records them (planning/compile_store.py). train.py, eval.py and plan.py all call `configure()`; this module is in
trainer/ because training sets the flags too (planning/ reads it, never the other way round).
"""

from __future__ import annotations

import dataclasses
import os

from jax._src import hardware_utils  # JAX's own TPU detection (PCI ids), usable before any backend starts

INIT_ARGS = "LIBTPU_INIT_ARGS"

MAXTEXT = "AI-Hypercomputer/maxtext@e591f30cbbf217ed67ef71263ec0538239f9c3b8"
TPU_RECIPES = "AI-Hypercomputer/tpu-recipes@c8cfe2f689081d36701a101cd73a70965d80926b"

# MaxText's benchmarks/xla_flags_library.py names the groups: "continuation fusion" of all-gathers with the compute
# beside them (CF_FOR_ALL_GATHER), data-parallel all-reduce pipelining (DATA_PARALLEL_OVERLAP), the scoped VMEM
# limit for dense models (DENSE_VMEM_LIMIT_FLAG).
_CF_FOR_ALL_GATHER = {
    "xla_tpu_enable_async_collective_fusion": "true",
    "xla_tpu_enable_async_collective_fusion_fuse_all_gather": "true",
    "xla_tpu_enable_async_collective_fusion_multiple_steps": "true",
    "xla_tpu_overlap_compute_collective_tc": "true",
    "xla_enable_async_all_gather": "true",
}
_DATA_PARALLEL_OVERLAP = {
    "xla_tpu_enable_data_parallel_all_reduce_opt": "true",
    "xla_tpu_data_parallel_opt_different_sized_ops": "true",
}
# "Better memory layout for all-reduce" (LAYOUT_FOR_ALL_REDUCE_SCATTER): lays out FSDP's gradient reductions so they
# need no padded, permute-decomposed reduce-scatter (gpt2_xl_pod on v5e:16x16: 390.5 -> 367.2 ms predicted)
_LAYOUT_FOR_ALL_REDUCE_SCATTER = {
    "xla_tpu_use_minor_sharding_for_major_trivial_input": "true",
    "xla_tpu_relayout_group_size_threshold_for_reduce_scatter": "1",
    "xla_tpu_assign_all_reduce_scatter_layout": "true",
}


GROUPS = {"continuation fusion of all-gathers (CF_FOR_ALL_GATHER)": _CF_FOR_ALL_GATHER,
          "data-parallel all-reduce pipelining (DATA_PARALLEL_OVERLAP)": _DATA_PARALLEL_OVERLAP,
          "all-reduce-scatter layout (LAYOUT_FOR_ALL_REDUCE_SCATTER)": _LAYOUT_FOR_ALL_REDUCE_SCATTER}


@dataclasses.dataclass(frozen=True)
class ShippedFlags:
    """The LIBTPU_INIT_ARGS of a published dense-decoder training configuration for one generation."""

    source: str  # repository@commit and file
    flags: dict[str, str]

    def init_args(self) -> str:
        return " ".join(f"--{name}={value}" for name, value in self.flags.items())


COLLECTIVE_FLAGS = {
    # the 22B configuration of the back-test's maxtext_22b_v4 entry; its LIBTPU_INIT_ARGS also holds
    # "TPU_MEGACORE=MEGACORE_DENSE", which is no flag (megacore is the chip configuration aot.py compiles with)
    "v4": ShippedFlags(f"{MAXTEXT} src/maxtext/configs/tpu/v4/22b.sh", {"xla_enable_async_all_gather": "true"}),
    # the 16B configuration of the back-test's maxtext_16b_v5e entry (61.1 % MFU on a v5e-256), which
    # benchmarks/maxtext_v5e_model_configs.py gives every dense v5e model, and the all-reduce-scatter layout its
    # Llama 3.1 8B on v5e-256 adds (its SparseCore and host-offload flags are for what v5e lacks or we do not do;
    # its scoped VMEM limit made gpt2_xl_pod's ops 31 ms slower)
    "v5e": ShippedFlags(f"{MAXTEXT} src/maxtext/configs/tpu/v5e/16b.sh + benchmarks/maxtext_v5e_model_configs.py"
                        " llama3_1_8b_8192_v5e_256",
                        {**_DATA_PARALLEL_OVERLAP, **_CF_FOR_ALL_GATHER, **_LAYOUT_FOR_ALL_REDUCE_SCATTER}),
    "v5p": ShippedFlags(f"{MAXTEXT} src/maxtext/configs/tpu/v5p/128b.sh", {
        "xla_tpu_enable_async_collective_fusion_fuse_all_gather": "true",
        "xla_tpu_megacore_fusion_allow_ags": "false",
        "xla_enable_async_collective_permute": "true",
        "xla_tpu_enable_ag_backward_pipelining": "true",
        **_DATA_PARALLEL_OVERLAP, **_CF_FOR_ALL_GATHER,
    }),
    # tpu-recipes' GPT-3 175B bf16 recipe runs MaxText's model "gpt_3_175b_bf16", whose flags are these
    "v6e": ShippedFlags(
        f"{TPU_RECIPES} training/trillium/GPT3-175B-MaxText/bf16/gpt3-175b-v6e-256.sh -> {MAXTEXT}"
        " benchmarks/maxtext_trillium_model_configs.py gpt_3_175b_bf16",
        {"xla_tpu_scoped_vmem_limit_kib": "98304", **_CF_FOR_ALL_GATHER, **_DATA_PARALLEL_OVERLAP,
         "xla_tpu_use_bundle_aware_cost_model_for_fusions": "false"}),
}

# A machine without a TPU: libtpu runs as one host of its own (see the module docstring)
NO_TPU = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_HOST_BOUNDS": "1,1,1"}


def configure(environ=os.environ) -> None:
    """Sets the environment libtpu reads for this machine; the user's own values are kept. Call it before JAX
    initializes its backends."""
    chips, version = hardware_utils.num_available_tpu_chips_and_device_id()
    if not chips:
        for name, value in NO_TPU.items():
            environ.setdefault(name, value)
        return
    shipped = COLLECTIVE_FLAGS.get(getattr(version, "name", ""))  # COLLECTIVE_FLAGS is keyed by TpuVersion's names
    if shipped is not None and INIT_ARGS not in environ:
        environ[INIT_ARGS] = shipped.init_args()


def compile_options(generation: str) -> dict[str, str]:
    """The flags an ahead-of-time compile for `generation` uses: its COLLECTIVE_FLAGS, as train.py would set them
    on that TPU — or none when the user set LIBTPU_INIT_ARGS, which libtpu then applies to every compile."""
    if os.environ.get(INIT_ARGS) is not None:
        return {}
    shipped = COLLECTIVE_FLAGS.get(generation)
    return dict(shipped.flags) if shipped else {}
