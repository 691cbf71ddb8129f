"""Each TPU generation's published figures (per chip): peak FLOP/s, HBM, ICI links, the hosts' data-center network.
The step-time model and the AOT report read them; training itself needs only the peak FLOP/s (trainer/hardware.py).
"""

from __future__ import annotations

import dataclasses

from trainer.hardware import PEAK_FLOPS


@dataclasses.dataclass(frozen=True)
class Chip:
    """A TPU generation's published figures (per chip)."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes: int
    hbm_bytes_per_s: float
    ici_link_bytes_per_s: float  # one ICI link, one direction
    host: tuple[int, int, int]  # a multi-host slice's host, for topologies (cut to a smaller slice: aot.host_bounds)
    # libtpu's chip configuration: "megacore" makes a chip of two TensorCores (v4, v5p) one JAX device, as JAX
    # requires for meshes on those chips (and as a v4-8's 4 chips run); "default" gives one device per core
    chip_config: str = "default"
    dcn_host_bits_per_s: float = 0.0  # a host's data-center network NICs, one direction (DCN_NIC_BITS_PER_S)
    chips_per_host: int = 1  # the chips that share those NICs (a TPU VM's chips, not `host` above)

    @property
    def ring_bytes_per_s(self) -> float:
        # a bidirectional ring along one mesh axis sends on two links at once (both directions of one torus dimension)
        return 2 * self.ici_link_bytes_per_s

    @property
    def dcn_bytes_per_s(self) -> float:
        """One chip's share of its host's DCN bandwidth, when every chip of the host sends across slices at once
        (as in a data-parallel gradient reduction)."""
        return self.dcn_host_bits_per_s / 8 / self.chips_per_host


# Cloud TPU documentation, "TPU v4" / "TPU v5e" / "TPU v5p" / "TPU v6e" pages (cloud.google.com/tpu/docs/v4, .../v5e,
# .../v5p, .../v6e): HBM capacity and bandwidth per chip; bidirectional ICI bandwidth per chip over its ports
# (v5e 400 GBps / 4 ports, v5p 1200 GBps / 6 ports, v6e 800 GBps / 4 ports -> 50, 100, 100 GB/s per port and
# direction). The v4 page gives no ICI figure: 6 links of 400 Gbit/s (50 GB/s) per direction is from the TPU v4
# paper (Jouppi et al., "TPU v4: An Optically Reconfigurable Supercomputer...", ISCA 2023, arXiv:2304.01433).
# Peak bf16 FLOP/s: PEAK_FLOPS above (the same pages).
# HBM sizes stay in GiB as the AOT report has always compared them (the compiler reports 15.75 GiB usable on v5e).
#
# Data-center network (DCN), which joins the slices of a multislice job: each host's NICs, shared by the chips of
# the host. Cloud TPU documentation: v5e "Per-host NIC configuration: 2 x 100 Gbps NIC" with 8 chips per host, v6e
# "4 x 200 Gbps NIC" with 8 chips per host (cloud.google.com/tpu/docs/v5e, .../v6e); v5p "Data center network (DCN)
# bandwidth per chip: 50 Gbps", 4 chips per VM (.../v5p). The v4 page states no DCN figure: v4 is given v5p's
# 50 Gbps per chip on its 4-chip hosts, an assumption, not a published number.
DCN_NIC_BITS_PER_S = {"v4": 4 * 50e9, "v5e": 2 * 100e9, "v5p": 4 * 50e9, "v6e": 4 * 200e9}  # per host, one direction
CHIPS_PER_HOST = {"v4": 4, "v5e": 8, "v5p": 4, "v6e": 8}


def _chip(name: str, peak: float, hbm: int, hbm_rate: float, ici_link: float, config: str = "default") -> Chip:
    return Chip(name, peak, hbm, hbm_rate, ici_link, (2, 2, 1), config, DCN_NIC_BITS_PER_S[name], CHIPS_PER_HOST[name])


CHIPS = {
    "v4": _chip("v4", PEAK_FLOPS["TPU v4"], 32 * 2**30, 1200e9, 50e9, "megacore"),
    "v5e": _chip("v5e", PEAK_FLOPS["TPU v5e"], 16 * 2**30, 819e9, 50e9),
    "v5p": _chip("v5p", PEAK_FLOPS["TPU v5p"], 95 * 2**30, 2765e9, 100e9, "megacore"),
    "v6e": _chip("v6e", PEAK_FLOPS["TPU v6e"], 32 * 2**30, 1638e9, 100e9),
}
