"""The cost model of one device and of the all-reduce between devices: what a
micro-step of b samples costs (t = a + c·b, the balancer's model), how large a
micro-batch fits in memory, what the optimizer update and the ring all-reduce cost.

Every figure comes from public peak specifications times an efficiency, and each
constant below says where it comes from; a profile of a real run (hetcomm.plan.
calibrate) replaces the efficiency, or the whole per-device line, by measurement.
"""

import math
from dataclasses import dataclass

from hetcomm.plan.catalog import Device, Link
from hetcomm.plan.model_shape import ModelShape

# A sample's compute is its matmuls at a share of peak FLOP/s plus its memory-bound
# work (normalisations, activations, residual adds, the loss) at a share of memory
# bandwidth. Eager PyTorch's matmuls reach about 70% of a SIMT peak and 50% of a
# tensor-core peak at these sizes; the memory-bound kernels move each stored activation
# about three times (written in forward, read in backward with its gradient written).
DEFAULT_EFFICIENCY = {False: 0.7, True: 0.5}   # by "computes on tensor cores"
ACTIVATION_TRAFFIC = 3
# Per-micro-step fixed cost: the kernels launched by forward and backward (about 40
# per transformer block plus 30 for embeddings, head and loss), each paying the
# framework's dispatch overhead on the host, and one read of the weights per pass.
KERNELS_PER_LAYER, KERNELS_OUTSIDE_LAYERS = 40, 30
SECONDS_PER_KERNEL = 12e-6
# The weights' traffic per micro-step, as the trainer computes (16-bit precisions: 16-bit
# weights with fp32 masters): read in forward and in backward, the gradient written;
# 4-byte elements in fp32, 2-byte ones in 16-bit.
WEIGHT_BYTES_PER_MICRO_STEP = {"fp32": 12, "fp16": 6, "bf16": 6}
# The optimizer step per optimizer step: AdamW reads weight, grad and both moments and
# writes three of them (28 bytes per fp32 parameter), clipping rescales the grads (8),
# the reducer packs and unpacks them (12 for fp32 gradients; 10 from 16-bit ones into
# fp32 masters, which one cast then copies back: 6); memory-bound, at this share of peak
# bandwidth.
UPDATE_BYTES_PER_PARAMETER = {"fp32": 48, "fp16": 52, "bf16": 52}
BANDWIDTH_EFFICIENCY = 0.7
# Memory: fp32 weights, grads and AdamW's two moments (16 bytes per parameter); computing
# in 16-bit, 16-bit weights and grads beside fp32 masters, their grads and the moments
# (20); plus the reducer's wire buffers.
STATE_BYTES_PER_PARAMETER = {"fp32": 16, "fp16": 20, "bf16": 20}
CONTEXT_BYTES = 0.5 * 2**30   # the CUDA context and the kernels of torch's libraries
# Gradient bytes per all-reduce: the reducer's bucket size (hetcomm.comm, like DDP).
BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class DeviceCost:
    """What one device costs for one model, sequence length and precision."""

    precision: str
    fixed: float                  # a: seconds per micro-step whatever its size
    per_sample: float             # c: seconds per sample
    cap: int | None               # the largest micro-batch that fits; None: no limit known (CPU)
    state_bytes: float            # weights, grads, optimizer state, wire buffers, context
    activation_bytes: float       # per sample of the micro-batch
    memory_bytes: float | None    # what the device offers under the memory fraction
    update_seconds: float         # the optimizer update, once per optimizer step
    efficiency: float | None      # the share of peak FLOP/s assumed; None: measured line

    def memory_use(self, micro_batch: int) -> float:
        return self.state_bytes + self.activation_bytes * micro_batch


def micro_batch_cap(memory_bytes: float, state_bytes: float, activation_bytes: float) -> int:
    """The largest micro-batch whose activations fit beside the state (0: none)."""
    room = memory_bytes - state_bytes
    return max(0, math.floor(room / activation_bytes)) if room > 0 else 0


def device_cost(device: Device, model: ModelShape, seq: int, precision: str, *, wire_bytes: int,
                memory_fraction: float, efficiency: float | None = None) -> DeviceCost:
    """The cost of `model` on `device` computing in `precision` (ValueError naming the
    device where the precision has no native support)."""
    peak = device.peak_tflops(precision) * 1e12
    tensor = device.tensor_cores and precision != "fp32"
    if efficiency is None:
        efficiency = DEFAULT_EFFICIENCY[tensor]
    parameters = model.parameters(seq)
    bandwidth = device.bandwidth_gbs * 1e9
    fixed = ((KERNELS_PER_LAYER * model.n_layer + KERNELS_OUTSIDE_LAYERS) * SECONDS_PER_KERNEL
             + parameters * WEIGHT_BYTES_PER_MICRO_STEP[precision] / (bandwidth * BANDWIDTH_EFFICIENCY))
    per_sample = model.flops_per_sample(seq) / (peak * efficiency) + memory_bound_seconds(device, model, seq, precision)
    state = parameters * (STATE_BYTES_PER_PARAMETER[precision] + wire_bytes) + CONTEXT_BYTES
    activation = model.activation_bytes_per_sample(seq, precision)
    memory = device.memory_gib * 2**30 * memory_fraction
    return DeviceCost(precision=precision, fixed=fixed, per_sample=per_sample,
                      cap=micro_batch_cap(memory, state, activation), state_bytes=state,
                      activation_bytes=activation, memory_bytes=memory,
                      update_seconds=update_seconds(parameters, bandwidth, precision), efficiency=efficiency)


def update_seconds(parameters: int, bandwidth_bytes_per_s: float, precision: str) -> float:
    return parameters * UPDATE_BYTES_PER_PARAMETER[precision] / (bandwidth_bytes_per_s * BANDWIDTH_EFFICIENCY)


def memory_bound_seconds(device: Device, model: ModelShape, seq: int, precision: str) -> float:
    """Per sample, the memory-bound part of forward and backward."""
    traffic = ACTIVATION_TRAFFIC * model.activation_bytes_per_sample(seq, precision)
    return traffic / (device.bandwidth_gbs * 1e9 * BANDWIDTH_EFFICIENCY)


def measured_efficiency(device: Device, model: ModelShape, seq: int, precision: str, per_sample: float) -> float:
    """The share of peak FLOP/s that a measured per-sample time means on this device,
    once its memory-bound part is taken out (at most 1: a faster measurement than the
    memory-bound part alone allows says the model overcounts memory, not that the
    matmuls beat peak)."""
    matmul_seconds = per_sample - memory_bound_seconds(device, model, seq, precision)
    peak = device.peak_tflops(precision) * 1e12
    return min(1.0, model.flops_per_sample(seq) / (peak * matmul_seconds)) if matmul_seconds > 0 else 1.0


@dataclass(frozen=True)
class AllReduceCost:
    seconds: float          # the all-reduce of one step's gradients
    wire_bytes: float       # bytes each rank sends
    buckets: int
    algorithm: str          # "ring" or "tree"


def all_reduce_cost(ranks: int, parameters: int, wire_bytes: int, link: Link) -> AllReduceCost:
    """The faster of NCCL's two all-reduce algorithms for every gradient in wire_bytes
    per element, through the slowest link crossed (nccl-tests' cost model):
    ring: each rank sends 2(N-1)/N of the data, every bucket pays 2(N-1) latencies;
    tree (pipelined reduce then broadcast): about twice the data, 2·log2(N) latencies.
    The ring wins on bandwidth, the tree on latency once there are thousands of ranks."""
    if ranks < 2:
        return AllReduceCost(0.0, 0.0, 0, "none")
    buckets = max(1, math.ceil(parameters * 4 / BUCKET_BYTES))
    data = parameters * wire_bytes
    bandwidth, latency = link.bandwidth_gbs * 1e9, link.latency_us * 1e-6
    ring_sent = 2 * (ranks - 1) / ranks * data
    ring = AllReduceCost(ring_sent / bandwidth + buckets * 2 * (ranks - 1) * latency, ring_sent, buckets, "ring")
    tree = AllReduceCost(2 * data / bandwidth + buckets * 2 * math.ceil(math.log2(ranks)) * latency, 2 * data,
                         buckets, "tree")
    return min(ring, tree, key=lambda cost: cost.seconds)


def exposed_communication(all_reduce: AllReduceCost, backward_seconds: float, overlap: bool) -> float:
    """The all-reduce time the step waits for: all of it when it starts after backward
    (`hetcomm train`, WeightedReducer.reduce), or, when buckets go out during backward
    (overlap=True), what the slowest rank's backward does not cover — at least the last
    bucket, which can only start once backward is done."""
    if not overlap or all_reduce.buckets == 0:
        return all_reduce.seconds
    return max(all_reduce.seconds / all_reduce.buckets, all_reduce.seconds - backward_seconds)
