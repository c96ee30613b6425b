"""Catalogue of devices, links and named cluster presets, each figure with its public source.

Peak FLOP/s, memory and memory bandwidth are vendor datasheet figures (dense, no sparsity).
Link bandwidths are per direction, from the standard or datasheet that defines them. Latencies and
sustained efficiencies are *not* datasheet figures: they are typical values, marked "estimate" in
their source string; run ``hpoflow oracle calibrate`` on a real machine to replace them.

Entries are plain mappings so that a cluster YAML can name them (``device: v100``) or spell a
device out in full; :mod:`hpoflow.oracle.cluster` validates both the same way.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DEVICES", "LINKS", "PRECISION_BYTES", "PRESETS", "STRATEGIES"]

_G = 1e9
_GIB = 2**30  # device memory: vendors' "16 GB" of HBM is 16 GiB; bandwidths stay decimal GB/s

# bytes per value of each training precision (weights, gradients, activations)
PRECISION_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2}
# how the oracle prices data parallelism (hpoflow.oracle.model); training strategies map onto these
STRATEGIES = ("ring", "tree", "ps", "easgd", "pipeline")
_T = 1e12
_EFF = "estimate: typical sustained fraction of peak for CNN training; calibrate to replace"

DEVICES: dict[str, dict[str, Any]] = {
    "cpu": {
        "name": "generic CPU core (AVX2, 2.0 GHz)",
        "peak_flops": {"fp32": 64 * _G, "fp16": 64 * _G, "bf16": 64 * _G},
        "memory_bytes": 4 * _G,
        "memory_bandwidth": 10 * _G,
        "efficiency": 0.5,
        "source": "arithmetic: 2 FMA units x 8 fp32 lanes x 2 FLOP x 2.0 GHz; 4 GB DRAM and "
                  "10 GB/s per core assumed; " + _EFF,
    },
    "p100": {
        "name": "NVIDIA Tesla P100 SXM2 16GB",
        "peak_flops": {"fp32": 10.6 * _T, "fp16": 21.2 * _T, "bf16": 10.6 * _T},
        "memory_bytes": 16 * _GIB,
        "memory_bandwidth": 732 * _G,
        "efficiency": {"fp32": 0.6, "fp16": 0.45, "bf16": 0.6},
        "source": "NVIDIA Tesla P100 datasheet (SXM2: 10.6 TFLOPS fp32, 21.2 fp16, 16 GB "
                  "HBM2 at 732 GB/s; no bf16, runs at fp32 rate); " + _EFF,
    },
    "v100": {
        "name": "NVIDIA Tesla V100 SXM2 16GB",
        "peak_flops": {"fp32": 15.7 * _T, "fp16": 125 * _T, "bf16": 15.7 * _T},
        "memory_bytes": 16 * _GIB,
        "memory_bandwidth": 900 * _G,
        "efficiency": {"fp32": 0.6, "fp16": 0.25, "bf16": 0.6},
        "source": "NVIDIA Tesla V100 datasheet (SXM2: 15.7 TFLOPS fp32, 125 tensor fp16, "
                  "16 GB HBM2 at 900 GB/s; no bf16); " + _EFF,
    },
    "a100": {
        "name": "NVIDIA A100 SXM4 80GB",
        "peak_flops": {"fp32": 19.5 * _T, "fp16": 312 * _T, "bf16": 312 * _T},
        "memory_bytes": 80 * _GIB,
        "memory_bandwidth": 2039 * _G,
        "efficiency": {"fp32": 0.6, "fp16": 0.2, "bf16": 0.2},
        "source": "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB: 19.5 TFLOPS fp32, "
                  "312 fp16/bf16 dense, 2,039 GB/s HBM2e); " + _EFF,
    },
    "h100": {
        "name": "NVIDIA H100 SXM5 80GB",
        "peak_flops": {"fp32": 67 * _T, "fp16": 989 * _T, "bf16": 989 * _T},
        "memory_bytes": 80 * _GIB,
        "memory_bandwidth": 3350 * _G,
        "efficiency": {"fp32": 0.5, "fp16": 0.15, "bf16": 0.15},
        "source": "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 67 TFLOPS fp32, 989 fp16/bf16 "
                  "dense, 80 GB HBM3 at 3.35 TB/s); " + _EFF,
    },
}

_LAT = "latency is an estimate of software per-message latency"

LINKS: dict[str, dict[str, Any]] = {
    "pcie3": {"name": "PCIe 3.0 x16", "bandwidth": 15.75 * _G, "latency": 5e-6,
              "source": "PCI-SIG PCIe 3.0 base specification (8 GT/s x16, 128b/130b); " + _LAT},
    "pcie4": {"name": "PCIe 4.0 x16", "bandwidth": 31.5 * _G, "latency": 5e-6,
              "source": "PCI-SIG PCIe 4.0 base specification (16 GT/s x16, 128b/130b); " + _LAT},
    "nvlink1": {"name": "NVLink 1.0 (P100)", "bandwidth": 80 * _G, "latency": 5e-6,
                "source": "NVIDIA Tesla P100 datasheet (160 GB/s bidirectional NVLink); " + _LAT},
    "nvlink2": {"name": "NVLink 2.0 (V100)", "bandwidth": 150 * _G, "latency": 5e-6,
                "source": "NVIDIA Tesla V100 datasheet (300 GB/s NVLink); " + _LAT},
    "nvlink3": {"name": "NVLink 3.0 (A100)", "bandwidth": 300 * _G, "latency": 5e-6,
                "source": "NVIDIA A100 datasheet (600 GB/s NVLink); " + _LAT},
    "nvlink4": {"name": "NVLink 4.0 (H100)", "bandwidth": 450 * _G, "latency": 5e-6,
                "source": "NVIDIA H100 datasheet (900 GB/s NVLink); " + _LAT},
    "10gbe": {"name": "10 Gigabit Ethernet (TCP)", "bandwidth": 1.25 * _G, "latency": 30e-6,
              "source": "IEEE 802.3ae (10 Gb/s); " + _LAT},
    "25gbe": {"name": "25 Gigabit Ethernet (TCP)", "bandwidth": 3.125 * _G, "latency": 20e-6,
              "source": "IEEE 802.3by (25 Gb/s); " + _LAT},
    "100gbe": {"name": "100 Gigabit Ethernet (TCP)", "bandwidth": 12.5 * _G, "latency": 15e-6,
               "source": "IEEE 802.3ba (100 Gb/s); " + _LAT},
    "ib-edr": {"name": "InfiniBand EDR", "bandwidth": 12.5 * _G, "latency": 2e-6,
               "source": "NVIDIA (Mellanox) ConnectX-5 product brief (EDR 100 Gb/s); " + _LAT},
    "ib-hdr": {"name": "InfiniBand HDR", "bandwidth": 25 * _G, "latency": 2e-6,
               "source": "NVIDIA ConnectX-6 product brief (HDR 200 Gb/s); " + _LAT},
    "ib-ndr": {"name": "InfiniBand NDR", "bandwidth": 50 * _G, "latency": 2e-6,
               "source": "NVIDIA ConnectX-7 product brief (NDR 400 Gb/s); " + _LAT},
}

PRESETS: dict[str, dict[str, Any]] = {
    "laptop": {"name": "laptop", "nodes": 1, "devices_per_node": 4, "device": "cpu",
               "intra_node": {"name": "shared memory (loopback)", "bandwidth": 2e9,
                              "latency": 50e-6, "source": "estimate for gloo over loopback"},
               "inter_node": "10gbe", "overlap": 0.0},
    "p100-cluster": {"name": "p100-cluster", "nodes": 16, "devices_per_node": 4,
                     "device": "p100", "intra_node": "nvlink1", "inter_node": "ib-edr"},
    "v100-cluster": {"name": "v100-cluster", "nodes": 16, "devices_per_node": 4,
                     "device": "v100", "intra_node": "nvlink2", "inter_node": "ib-edr"},
    "a100-cluster": {"name": "a100-cluster", "nodes": 16, "devices_per_node": 8,
                     "device": "a100", "intra_node": "nvlink3", "inter_node": "ib-hdr"},
    "h100-cluster": {"name": "h100-cluster", "nodes": 16, "devices_per_node": 8,
                     "device": "h100", "intra_node": "nvlink4", "inter_node": "ib-ndr"},
    "ethernet-cluster": {"name": "ethernet-cluster", "nodes": 8, "devices_per_node": 4,
                         "device": "v100", "intra_node": "pcie3", "inter_node": "25gbe"},
}
