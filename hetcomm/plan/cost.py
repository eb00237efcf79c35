"""The cost model of one device and of the all-reduce between devices: what a
micro-step of b samples costs (t = a + c·b, the balancer's model), how large a
micro-batch fits in memory, what the optimizer update and the ring all-reduce cost.

Every figure comes from public peak specifications times an efficiency fitted per
architecture and math to published training measurements (efficiency.csv, written by
hetcomm.plan.fit from measurements.csv), and each constant below says where it comes
from; a profile of a real run (hetcomm.plan.calibrate) replaces the efficiency, or the
whole per-device line, by measurement.
"""

import csv
import importlib.resources
import math
from dataclasses import dataclass
from functools import cache

from hetcomm.plan.catalog import Device, Link
from hetcomm.plan.model_shape import ATTENTIONS, GELUS, ModelShape

# The planner's precisions: the trainer's three, and tf32 (fp32 storage, matmuls on
# Ampere's tensor cores in TF32, what NGC containers and PyTorch before 1.12 did by default).
PLAN_PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
STORAGE = {"fp32": "fp32", "tf32": "fp32", "fp16": "fp16", "bf16": "bf16"}
# A sample's compute is its matmuls at a share of peak FLOP/s plus its memory-bound
# work (normalisations, activations, residual adds, the loss, eager attention's scores)
# at a share of memory bandwidth; the memory-bound kernels move each stored activation
# about three times (written in forward, read in backward with its gradient written).
# The share of peak is fitted per architecture and math (efficiency.csv); these are the
# fallbacks for a math no measurement covers.
DEFAULT_EFFICIENCY = {"fp32": 0.7, "tf32": 0.5, "tensor16": 0.5}
ACTIVATION_TRAFFIC = 3
# Eager attention's seq×seq scores go through a chain of kernels of their own, each
# reading and writing every score, so they cost more than three passes over what is
# kept of them: bytes per score and layer, forward and backward, in units of the element
# size e. Forward: QKᵀ writes them (1), the scaling by 1/sqrt(d) and the mask's addition
# read and write them (4), softmax (2), dropout (2, and a 1-byte mask), PV reads them (1):
# 10e + 1. Backward: PV's backward writes their gradient and reads them for V's (2),
# dropout (2, and the mask), softmax (3: gradient and output in, gradient out), the
# scaling (2), QKᵀ's two backward matmuls read the gradient (2): 11e + 1. Apex's amp O2
# runs the chain in fp16 (e = 2): 44. fp32: 86; autocast, which runs softmax and what
# follows in fp32 and casts back for PV (two casts each way), comes to the same 86.
# Counted as three passes over the 5-9 bytes kept, the scores moved 15-27 bytes: the
# cards with the most FLOP/s per byte of bandwidth (V100, RTX 8000, A100), whose eager
# BERT steps are the most memory-bound, were predicted up to a third too fast beside
# the others (benchmarks/results/cost_model_cpu.md: relative error mean 13.4% -> 12.0%).
SCORE_TRAFFIC_BYTES = {"fp32": 86, "fp16": 86, "bf16": 86, "o2": 44}
# Sustained clock under a training load, as a share of the boost clock the peak figures
# assume, for cards whose power cap holds them below it. T4 (70 W): a sustained 4096³
# fp16 cuBLAS GEMM reaches 24 of its 65 TFLOPS, NVIDIA's answer being its power cap
# (forums.developer.nvidia.com/t/about-gpu-peak-performance/264462), which is the
# base clock's rate (585 of 1590 MHz) and about half of what that GEMM reaches on
# Turing cards without the cap. An estimate: no T4 training run is in measurements.csv.
# A100 PCIe 40GB (250 W against the SXM4 board's 400 W, same peak figures): NVIDIA put its
# real-world performance at 90% of the SXM4 A100's (www.anandtech.com/show/15867, 2020-06-22);
# in measurements.csv it ran BERT at 0.86-0.93 of the SXM4 A100's speed in both lambda-2021
# and lambda-2022. The 300 W A40 and 150 W A10 have no published sustained clock, and their
# rows do not show one uniform derating (the A40's fp16 rows are within 8% of the fit).
SUSTAINED_CLOCK = {"t4": 0.5, "a100-pcie-40gb": 0.9}
# Per-micro-step fixed cost: the kernels launched by forward and backward (about 40
# per transformer block plus 30 for embeddings, head and loss), each paying the
# framework's dispatch overhead on the host, and one read of the weights per pass.
KERNELS_PER_LAYER, KERNELS_OUTSIDE_LAYERS = 40, 30
SECONDS_PER_KERNEL = 12e-6
# An optimizer that loops over the parameters in Python (BERT's BertAdam, run without
# amp by DeepLearningExamples' run_squad.py) launches each step of its arithmetic on its
# own: m = b1·m + (1-b1)·g (2 kernels, 20 bytes per parameter), v likewise with g² (2,
# 24), m / (sqrt(v) + eps) (3, 28), weight decay (2, 20), the learning rate (1, 8), the
# update (1, 12), and the gradient norm's clipping (2, 12): 13 kernels per tensor and
# 124 bytes per parameter, where a fused AdamW moves 28.
PER_TENSOR_OPTIMIZER_KERNELS, PER_TENSOR_OPTIMIZER_BYTES = 13, 124
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

    precision: str                # one of PLAN_PRECISIONS
    fixed: float                  # a: seconds per micro-step whatever its size
    per_sample: float             # c: seconds per sample
    cap: int | None               # the largest micro-batch that fits; None: no limit known (CPU)
    state_bytes: float            # weights, grads, optimizer state, wire buffers, context
    activation_bytes: float       # per sample of the micro-batch
    memory_bytes: float | None    # what the device offers under the memory fraction
    update_seconds: float         # the optimizer update, once per optimizer step
    efficiency: float | None      # the share of peak FLOP/s assumed; None: measured line
    attention: str = "fused"
    gelu: str = "fused"

    def memory_use(self, micro_batch: int) -> float:
        return self.state_bytes + self.activation_bytes * micro_batch


def micro_batch_cap(memory_bytes: float, state_bytes: float, activation_bytes: float) -> int:
    """The largest micro-batch whose activations fit beside the state (0: none)."""
    room = memory_bytes - state_bytes
    return max(0, math.floor(room / activation_bytes)) if room > 0 else 0


def math_of(device: Device, precision: str) -> str:
    """What the matmuls run on: "fp32" (SIMT), "tf32" or "tensor16" (tensor cores), or
    "fp16-fp32math": 16-bit storage with fp32 arithmetic, what cuBLAS's GemmEx (and so
    PyTorch's fp16 matmuls) does on cards without tensor cores, Pascal's included: their
    fp16 instructions (1/64 rate on sm_61) are never used, so fp16 costs no speed there
    and halves the memory traffic. ValueError naming the device when the precision
    needs hardware it lacks."""
    if precision not in PLAN_PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {', '.join(PLAN_PRECISIONS)}")
    major, minor = device.capability
    if precision in ("tf32", "bf16") and device.bf16_tflops is None:
        raise ValueError(f"{device.name} ({device.label}) has no native {precision} (compute capability "
                         f"{major}.{minor}, {precision} needs 8.0); use fp16 or fp32")
    if precision == "fp32":
        return "fp32"
    if precision == "tf32":
        return "tf32"
    return "tensor16" if device.tensor_cores else "fp16-fp32math"


def peak_flops(device: Device, precision: str) -> float:
    """The peak FLOP/s of the math `precision` runs on, at the sustained clock. Dense
    TF32 is half the 16-bit tensor rate on every Ampere, Ada and Hopper part."""
    math_ = math_of(device, precision)
    tflops = {"fp32": device.fp32_tflops, "fp16-fp32math": device.fp32_tflops,
              "tf32": (device.bf16_tflops or 0) / 2,
              "tensor16": device.peak_tflops(STORAGE[precision])}[math_]
    return tflops * 1e12 * SUSTAINED_CLOCK.get(device.name, 1.0)


def efficiency_keys(device: Device, precision: str) -> tuple[tuple[str, str], ...]:
    """The fitted efficiency's keys, most specific first: on tensor cores, the compute
    capability with the ratio of the 16-bit tensor peak to the fp32 one ("sm_86/2x":
    GeForce Ampere, whose tensor cores accumulate fp32 at half rate, against "sm_86/4x":
    A6000, A40, A10); then the compute capability (GA100 and GA102 are both Ampere, but
    differ), the architecture, and "*", every one pooled. fp16 storage with fp32 math
    runs on the fp32 units, so it shares their efficiency (what a 16-bit copy saves is
    costed as memory traffic)."""
    math_ = math_of(device, precision)
    math_ = "fp32" if math_ == "fp16-fp32math" else math_
    major, minor = device.capability
    general = ((f"sm_{major}{minor}", math_), (device.architecture, math_), ("*", math_))
    if math_ == "fp32":
        return general
    ratio = round(device.fp16_tflops / device.fp32_tflops)
    return ((f"sm_{major}{minor}/{ratio}x", math_), *general)


# The key of the fitted share of a tensor-core matmul's time that does not scale with the
# tensor peak (loads, epilogues, the SIMT work around the MMA), in units of the time the
# matmul would take at the fp32 peak: what makes GeForce cards, whose tensor cores
# accumulate fp32 at half rate, reach a larger share of their tensor peak than A100s.
SIMT_SHARE_KEY = ("*", "simt-share")


@cache
def fitted_efficiencies() -> dict[tuple[str, str], float]:
    """efficiency.csv: (level, math) -> share of peak, and SIMT_SHARE_KEY."""
    text = (importlib.resources.files("hetcomm") / "plan" / "efficiency.csv").read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    return {(row["level"], row["math"]): float(row["value"]) for row in csv.DictReader(lines)}


def lookup_efficiency(keys: tuple[tuple[str, str], ...], table: dict[tuple[str, str], float]) -> float:
    for key in keys:
        if key in table:
            return table[key]
    return DEFAULT_EFFICIENCY[keys[0][1]]


def matmul_seconds(device: Device, model: ModelShape, seq: int, precision: str, efficiency: float,
                   simt_share: float = 0.0, fp32_efficiency: float | None = None) -> float:
    """Per sample: the FLOPs at `efficiency` of the peak, plus, on tensor cores,
    simt_share of their time at the fp32 peak. TF32 is never slower than the fp32
    SIMT kernels at fp32_efficiency, which cuBLAS picks where they are faster (on
    GeForce Ampere the TF32 tensor peak is no higher than the fp32 one)."""
    flops = model.flops_per_sample(seq)
    seconds = flops / (peak_flops(device, precision) * efficiency)
    if math_of(device, precision) in ("tf32", "tensor16"):
        seconds += simt_share * flops / peak_flops(device, "fp32")
    if precision == "tf32" and fp32_efficiency is not None:
        seconds = min(seconds, flops / (peak_flops(device, "fp32") * fp32_efficiency))
    return seconds


def device_cost(device: Device, model: ModelShape, seq: int, precision: str, *, wire_bytes: int,
                memory_fraction: float, efficiency: float | None = None, attention: str = "fused",
                efficiencies: dict[tuple[str, str], float] | None = None,
                activations: str | None = None, gelu: str = "fused") -> DeviceCost:
    """The cost of `model` on `device` computing in `precision` (ValueError naming the
    device where the precision has no native support). `efficiency` overrides the
    fitted share of peak; `efficiencies` replaces the fitted table (for the fit itself);
    `activations` = "o2" costs fp16's activations as apex's amp O2 keeps them (the
    published runs; the planner's own fp16 is autocast's). `gelu` = "composite" keeps
    the MLP's GELU as BERT-era code wrote it (model_shape): more memory; the step time
    still counts one GELU kernel, as every published speed measurement here ran one."""
    if attention not in ATTENTIONS:
        raise ValueError(f"--attention {attention!r}: expected one of {', '.join(ATTENTIONS)}")
    if gelu not in GELUS:
        raise ValueError(f"--gelu {gelu!r}: expected one of {', '.join(GELUS)}")
    simt_share, fp32_efficiency = 0.0, None   # a given efficiency is the whole share of peak
    if efficiency is None:
        table = fitted_efficiencies() if efficiencies is None else efficiencies
        efficiency = lookup_efficiency(efficiency_keys(device, precision), table)
        simt_share = table.get(SIMT_SHARE_KEY, 0.0)
        fp32_efficiency = lookup_efficiency(efficiency_keys(device, "fp32"), table)
    storage = STORAGE[precision]
    parameters = model.parameters(seq)
    bandwidth = device.bandwidth_gbs * 1e9
    fixed = ((KERNELS_PER_LAYER * model.n_layer + KERNELS_OUTSIDE_LAYERS) * SECONDS_PER_KERNEL
             + parameters * WEIGHT_BYTES_PER_MICRO_STEP[storage] / (bandwidth * BANDWIDTH_EFFICIENCY))
    kept = activations or storage
    per_sample = (matmul_seconds(device, model, seq, precision, efficiency, simt_share, fp32_efficiency)
                  + memory_bound_seconds(device, model, seq, precision, attention, kept))
    state = parameters * (STATE_BYTES_PER_PARAMETER[storage] + wire_bytes) + CONTEXT_BYTES
    activation = model.activation_bytes_per_sample(seq, kept, attention, gelu)
    memory = device.memory_gib * 2**30 * memory_fraction
    return DeviceCost(precision=precision, fixed=fixed, per_sample=per_sample,
                      cap=micro_batch_cap(memory, state, activation), state_bytes=state,
                      activation_bytes=activation, memory_bytes=memory,
                      update_seconds=update_seconds(parameters, bandwidth, precision), efficiency=efficiency,
                      attention=attention, gelu=gelu)


def per_tensor_optimizer_seconds(device: Device, model: ModelShape, seq: int) -> float:
    """The update of a Python-loop optimizer: its launches and its memory traffic."""
    return (model.parameter_tensors() * PER_TENSOR_OPTIMIZER_KERNELS * SECONDS_PER_KERNEL
            + model.parameters(seq) * PER_TENSOR_OPTIMIZER_BYTES / (device.bandwidth_gbs * 1e9 * BANDWIDTH_EFFICIENCY))


def update_seconds(parameters: int, bandwidth_bytes_per_s: float, precision: str) -> float:
    return parameters * UPDATE_BYTES_PER_PARAMETER[STORAGE[precision]] / (bandwidth_bytes_per_s * BANDWIDTH_EFFICIENCY)


def memory_bound_seconds(device: Device, model: ModelShape, seq: int, precision: str,
                         attention: str = "fused", activations: str | None = None) -> float:
    """Per sample, the memory-bound part of forward and backward: three passes over
    what is kept for backward, and eager attention's chain of kernels over the scores."""
    kept = activations or STORAGE[precision]
    traffic = ACTIVATION_TRAFFIC * model.activation_bytes_per_sample(seq, kept, "fused")
    if attention == "eager":
        traffic += SCORE_TRAFFIC_BYTES[kept] * model.n_layer * model.n_head * seq * seq
    return traffic / (device.bandwidth_gbs * 1e9 * BANDWIDTH_EFFICIENCY)


def measured_efficiency(device: Device, model: ModelShape, seq: int, precision: str, per_sample: float,
                        attention: str = "fused") -> float:
    """The share of peak FLOP/s that a measured per-sample time means on this device,
    once its memory-bound part is taken out (at most 1: a faster measurement than the
    memory-bound part alone allows says the model overcounts memory, not that the
    matmuls beat peak)."""
    matmul_seconds = per_sample - memory_bound_seconds(device, model, seq, precision, attention)
    peak = peak_flops(device, precision)
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
