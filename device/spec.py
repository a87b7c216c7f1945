"""The figures of the simulated NeuronCore, and the cost model built on them."""
from __future__ import annotations

import dataclasses

GiB = 1 << 30

# Note [Device assumptions]: every default below is an assumption, not a measurement of a
# real Trainium2. One logical NeuronCore (LNC=2) is taken as a quarter of a Trn2 chip
# (96 GiB HBM, 2.9 TB/s, ~667 dense BF16 TFLOP/s per chip, public launch figures). Launch
# overhead and compile time are order-of-magnitude figures from the third-party report in
# adaptive_eager/REFERENCE.md (~0.22 ms per eager elementwise op, most of it host + launch
# overhead).


_POSITIVE = ("hbm_bytes", "sbuf_bytes", "max_in_flight", "chip_cores", "ranks_per_instance")


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """Figures of one simulated logical NeuronCore; all overridable."""

    hbm_bytes: int = 24 * GiB  # assumption: 96 GiB per chip / 4 logical cores
    sbuf_bytes: int = 24 * 2**20  # assumption: on-chip SBUF of one NeuronCore (24 MiB)
    hbm_bandwidth_gbps: float = 725.0  # assumption: 2.9 TB/s per chip / 4, in GB/s
    peak_tflops_bf16: float = 167.0  # assumption: ~667 dense BF16 TFLOP/s per chip / 4
    peak_tflops_fp32: float = 42.0  # assumption: a quarter of the BF16 rate
    launch_overhead_us: float = 20.0  # assumption: fixed cost of one executable launch
    dma_overhead_us: float = 5.0  # assumption: fixed cost of one host<->device DMA
    host_link_gbps: float = 25.0  # assumption: host<->device bandwidth (PCIe-class), GB/s
    host_op_overhead_us: float = 10.0  # assumption: host time to dispatch one op (sim. clock)
    compile_base_us: float = 200_000.0  # assumption: fixed cost of one compile (0.2 s)
    compile_per_op_us: float = 20_000.0  # assumption: added compile cost per fused op
    max_in_flight: int = 8  # the reference runtime keeps up to 8 launches in flight
    chip_cores: int = 4  # assumption: logical NeuronCores (LNC=2) on the simulated Trn2 chip
    # Note [Interconnect assumptions]: one ring link per rank. NeuronLink-v3 is announced
    # at ~1.28 TB/s per Trn2 chip (public launch figure); a quarter of it per logical core.
    # Beyond one instance the links are the network (EFA), slower: see device/interconnect.py.
    interconnect_gbps: float = 320.0  # assumption: per-rank link bandwidth, GB/s, one way
    interconnect_latency_us: float = 5.0  # assumption: latency of one hop (one ring step)
    # Past one instance the hops are the network (Note [Two-level interconnect] in
    # device/interconnect.py). A trn2.48xlarge holds 16 Trn2 chips (64 logical cores) and
    # 3.2 Tbps of EFAv3 (public launch figures): 400 GB/s per instance, shared by its ranks.
    ranks_per_instance: int = 64  # assumption: 16 chips x chip_cores logical cores
    inter_instance_gbps: float = 400.0  # assumption: EFA bandwidth per instance, GB/s, one way
    inter_instance_latency_us: float = 15.0  # assumption: latency of one hop over EFA

    def __post_init__(self):
        """Refuse what the cost model cannot use, naming the field (a zero bandwidth was a
        ZeroDivisionError, `max_in_flight=0` an IndexError, at the next op)."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            positive = f.name in _POSITIVE or "gbps" in f.name or "tflops" in f.name
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or (
                    v <= 0 if positive else v < 0):
                raise ValueError(f"DeviceSpec.{f.name} must be a number "
                                 f"{'above 0' if positive else 'of at least 0'}, got {v!r}")

    def launch_us(self, nbytes: int, flops: float, low_precision: bool = False) -> float:
        """Launch overhead + max(bytes / bandwidth, FLOPs / peak), in microseconds."""
        mem_us = nbytes / (self.hbm_bandwidth_gbps * 1e3)
        peak = self.peak_tflops_bf16 if low_precision else self.peak_tflops_fp32
        compute_us = flops / (peak * 1e6)
        return self.launch_overhead_us + max(mem_us, compute_us)

    def dma_us(self, nbytes: int) -> float:
        """One host<->device copy."""
        return self.dma_overhead_us + nbytes / (self.host_link_gbps * 1e3)

    def compile_us(self, n_ops: int) -> float:
        """Modeled compile time of an executable holding n_ops ops."""
        return self.compile_base_us + self.compile_per_op_us * max(n_ops - 1, 0)

    def fingerprint(self) -> str:
        """Stable text naming every figure; part of the disk-cache key."""
        return repr(dataclasses.astuple(self))
