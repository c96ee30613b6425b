"""Catalogue of devices, links and named cluster presets, each figure with its public source.

Peak FLOP/s, memory and memory bandwidth are vendor datasheet figures (dense, no sparsity; memory
in GiB, as vendors mean it for HBM: a "16 GB" V100 has 16 GiB). Link bandwidths are per direction,
from the standard or datasheet that defines them. Per-hop latencies of NVLink, PCIe and InfiniBand
are the ones NCCL's own tuning model uses. Sustained fractions of peak (``efficiency`` of matrix
kernels, ``memory_efficiency`` of memory-bound ones), the fixed time of a kernel, the memory the
CUDA context and libraries reserve and Ethernet latencies are *not* datasheet figures: they are
typical values, marked "estimate" in their source string; run ``hpoflow oracle calibrate`` on a
real machine to replace them.

Entries are plain mappings so that a cluster YAML can name them (``device: v100``) or spell a
device out in full; :mod:`hpoflow.oracle.cluster` validates both the same way.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ALGORITHMS", "DEVICES", "LINKS", "PRECISION_BYTES", "PRESETS", "STRATEGIES"]

_G = 1e9
_GIB = 2**30

#: bytes per activation value of each training precision (fp16/bf16 are mixed precision: 16-bit
#: activations and matrix inputs, fp32 master weights, gradients and optimizer state; tf32 is fp32
#: storage with TF32 matrix units)
PRECISION_BYTES: dict[str, int] = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2}
#: how the oracle prices training: data parallel with an all-reduce (``allreduce``: the fastest
#: algorithm; ``ring``/``tree``: NCCL's flat ring or tree forced), a parameter server, periodic
#: averaging (``easgd``), a GPipe pipeline, and sharded data parallel (``zero1``: optimizer state
#: sharded, ``fsdp``: parameters, gradients and optimizer state sharded); training strategies map
#: onto these
STRATEGIES = ("allreduce", "ring", "tree", "ps", "easgd", "pipeline", "zero1", "fsdp")
#: all-reduce algorithms (hpoflow.oracle._comm), in the order ties are broken
ALGORITHMS = ("ring", "tree", "hier-ring", "hier-hd", "torus")
_T = 1e12
_EFF = ("estimate: matrix kernels at 80 % of peak, memory-bound kernels at 80 % of the memory "
        "bandwidth, 4 us fixed per kernel, 1 GiB reserved (CUDA context, library workspaces), "
        "5 % allocator overhead; calibrate to replace")

_GPU = {"efficiency": 0.8, "memory_efficiency": 0.8, "kernel_s": 4e-6, "reserved_bytes": 1 * _GIB,
        "memory_overhead": 0.05}

DEVICES: dict[str, dict[str, Any]] = {
    "cpu": {
        "name": "generic CPU core (AVX2, 2.0 GHz)",
        "peak_flops": {"fp32": 64 * _G, "fp16": 64 * _G, "bf16": 64 * _G},
        "memory_bytes": 4 * _G,
        "memory_bandwidth": 10 * _G,
        "efficiency": 0.5,
        "source": "arithmetic: 2 FMA units x 8 fp32 lanes x 2 FLOP x 2.0 GHz; 4 GB DRAM and "
                  "10 GB/s per core assumed; estimate: half of peak sustained; calibrate to replace",
    },
    "p100": {
        "name": "NVIDIA Tesla P100 SXM2 16GB",
        "peak_flops": {"fp32": 10.6 * _T, "fp16": 21.2 * _T},
        "memory_bytes": 16 * _GIB,
        "memory_bandwidth": 732 * _G,
        **_GPU,
        "source": "NVIDIA Tesla P100 datasheet (SXM2: 10.6 TFLOPS fp32, 21.2 fp16, 16 GB "
                  "HBM2 at 732 GB/s; no tensor cores, no bf16 or tf32: those run at the fp32 rate); " + _EFF,
    },
    "v100": {
        "name": "NVIDIA Tesla V100 SXM2 16GB",
        "peak_flops": {"fp32": 15.7 * _T, "fp16": 125 * _T},
        "memory_bytes": 16 * _GIB,
        "memory_bandwidth": 900 * _G,
        **_GPU,
        "source": "NVIDIA Tesla V100 datasheet (SXM2: 15.7 TFLOPS fp32, 125 tensor fp16, "
                  "16 GB HBM2 at 900 GB/s; no bf16 or tf32: those run at the fp32 rate); " + _EFF,
    },
    "a100": {
        "name": "NVIDIA A100 SXM4 80GB",
        "peak_flops": {"fp32": 19.5 * _T, "tf32": 156 * _T, "fp16": 312 * _T, "bf16": 312 * _T},
        "memory_bytes": 80 * _GIB,
        "memory_bandwidth": 2039 * _G,
        **_GPU,
        "source": "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB: 19.5 TFLOPS fp32, 156 tf32, "
                  "312 fp16/bf16 dense, 2,039 GB/s HBM2e); " + _EFF,
    },
    "h100": {
        "name": "NVIDIA H100 SXM5 80GB",
        "peak_flops": {"fp32": 67 * _T, "tf32": 494.5 * _T, "fp16": 989.5 * _T, "bf16": 989.5 * _T},
        "memory_bytes": 80 * _GIB,
        "memory_bandwidth": 3350 * _G,
        **_GPU,
        "source": "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 67 TFLOPS fp32, 494.5 tf32, 989.5 "
                  "fp16/bf16 dense, 80 GB HBM3 at 3.35 TB/s); " + _EFF,
    },
}

_LAT = "latency is an estimate of software per-message latency over TCP"
_NCCL = ("latency: NCCL's tuning model, per ring step with its Simple protocol (src/graph/tuning.cc: "
         "NVLink 3.4 us, PCI 5.7 us, network 9.6 us)")

LINKS: dict[str, dict[str, Any]] = {
    "pcie3": {"name": "PCIe 3.0 x16", "bandwidth": 15.75 * _G, "latency": 5.7e-6,
              "source": "PCI-SIG PCIe 3.0 base specification (8 GT/s x16, 128b/130b); " + _NCCL},
    "pcie4": {"name": "PCIe 4.0 x16", "bandwidth": 31.5 * _G, "latency": 5.7e-6,
              "source": "PCI-SIG PCIe 4.0 base specification (16 GT/s x16, 128b/130b); " + _NCCL},
    "nvlink1": {"name": "NVLink 1.0 (P100)", "bandwidth": 80 * _G, "latency": 3.4e-6,
                "source": "NVIDIA Tesla P100 datasheet (160 GB/s bidirectional NVLink); " + _NCCL},
    "nvlink2": {"name": "NVLink 2.0 (V100)", "bandwidth": 150 * _G, "latency": 3.4e-6,
                "source": "NVIDIA Tesla V100 datasheet (300 GB/s NVLink); " + _NCCL},
    "nvlink3": {"name": "NVLink 3.0 (A100)", "bandwidth": 300 * _G, "latency": 3.4e-6,
                "source": "NVIDIA A100 datasheet (600 GB/s NVLink); " + _NCCL},
    "nvlink4": {"name": "NVLink 4.0 (H100)", "bandwidth": 450 * _G, "latency": 3.4e-6,
                "source": "NVIDIA H100 datasheet (900 GB/s NVLink); " + _NCCL},
    "10gbe": {"name": "10 Gigabit Ethernet (TCP)", "bandwidth": 1.25 * _G, "latency": 30e-6,
              "source": "IEEE 802.3ae (10 Gb/s); " + _LAT},
    "25gbe": {"name": "25 Gigabit Ethernet (TCP)", "bandwidth": 3.125 * _G, "latency": 20e-6,
              "source": "IEEE 802.3by (25 Gb/s); " + _LAT},
    "50gbe": {"name": "50 Gigabit Ethernet (TCP)", "bandwidth": 6.25 * _G, "latency": 20e-6,
              "source": "IEEE 802.3cd (50 Gb/s); " + _LAT},
    "100gbe": {"name": "100 Gigabit Ethernet (TCP)", "bandwidth": 12.5 * _G, "latency": 15e-6,
               "source": "IEEE 802.3ba (100 Gb/s); " + _LAT},
    "ib-edr": {"name": "InfiniBand EDR", "bandwidth": 12.5 * _G, "latency": 9.6e-6,
               "source": "NVIDIA (Mellanox) ConnectX-5 product brief (EDR 100 Gb/s); " + _NCCL},
    "ib-hdr": {"name": "InfiniBand HDR", "bandwidth": 25 * _G, "latency": 9.6e-6,
               "source": "NVIDIA ConnectX-6 product brief (HDR 200 Gb/s); " + _NCCL},
    "ib-ndr": {"name": "InfiniBand NDR", "bandwidth": 50 * _G, "latency": 9.6e-6,
               "source": "NVIDIA ConnectX-7 product brief (NDR 400 Gb/s); " + _NCCL},
}

# NCCL's fixed cost of one collective (its tuning model's base latency, ring/Simple: 8.4 us) and
# the variation of a GPU's step time (step_jitter, the coefficient of variation): NVIDIA's
# DeepLearningExamples ResNet-50 v1.5 runs FP32 on one DGX-1 V100 at 7.76x the throughput of one
# GPU, where the NVLink all-reduce hides under the backward pass; read as the wait for the slowest
# of 8 GPUs (E[max of 8 standard normals] = 1.424): (8 / 7.76 - 1) / 1.424 = 0.022
_GPU_OVERHEADS = {"collective_s": 8.4e-6, "step_jitter": 0.022}

PRESETS: dict[str, dict[str, Any]] = {
    "laptop": {"name": "laptop", "nodes": 1, "devices_per_node": 4, "device": "cpu",
               "intra_node": {"name": "shared memory (loopback)", "bandwidth": 2e9,
                              "latency": 50e-6, "source": "estimate for gloo over loopback"},
               "inter_node": "10gbe", "overlap": 0.0, "backend": "gloo",
               "overheads": {"collective_s": 0.0, "step_jitter": 0.0}},
    "p100-cluster": {"name": "p100-cluster", "nodes": 16, "devices_per_node": 4,
                     "device": "p100", "intra_node": "nvlink1", "inter_node": "ib-edr",
                     "overheads": _GPU_OVERHEADS},
    "v100-cluster": {"name": "v100-cluster", "nodes": 16, "devices_per_node": 4,
                     "device": "v100", "intra_node": "nvlink2", "inter_node": "ib-edr",
                     "overheads": _GPU_OVERHEADS},
    # DGX A100 / DGX H100 nodes: 8 GPUs, 8 compute network adapters (one rail per GPU)
    "a100-cluster": {"name": "a100-cluster", "nodes": 16, "devices_per_node": 8,
                     "device": "a100", "intra_node": "nvlink3", "inter_node": "ib-hdr", "rails": 8,
                     "overheads": _GPU_OVERHEADS},
    "h100-cluster": {"name": "h100-cluster", "nodes": 16, "devices_per_node": 8,
                     "device": "h100", "intra_node": "nvlink4", "inter_node": "ib-ndr", "rails": 8,
                     "overheads": _GPU_OVERHEADS},
    "ethernet-cluster": {"name": "ethernet-cluster", "nodes": 8, "devices_per_node": 4,
                         "device": "v100", "intra_node": "pcie3", "inter_node": "25gbe",
                         "overheads": _GPU_OVERHEADS},
}
