"""Precision per device, and one dynamic loss scale shared by every rank.

The policy follows what each generation does well: every GPU before Ampere computes in
fp16 with a loss scale, and Ampere and newer in bf16; CPUs train in fp32. That holds
for Pascal GP102/GP104 too (sm_61: GTX 1080 Ti, Titan Xp, P40), whose fp16 arithmetic
runs at 1/64 rate, because PyTorch never uses it: cuBLAS computes fp16 matmuls in fp32
there, and elementwise kernels compute in fp32, so fp16 halves the memory traffic and
the activations at no arithmetic cost. Published BERT runs on a GTX 1080 Ti (lambdal/
deeplearning-benchmark, NGC 20.01, apex O2) trained 1.26x (BERT-base) and 1.95x
(BERT-large) faster in fp16 than in fp32, at the twice larger micro-batch fp16 fits
and with a fused optimizer where fp32 ran a Python loop; hetcomm's cost model, fitted
without those runs, predicts 1.29x and 1.81x for them, and for the same optimizer
3-10% faster steps and 1.2-1.8x the largest micro-batch on sm_61 cards
(hetcomm/plan/measurements.csv, benchmarks/bench_cost_model.py).

The loss scale is global: every rank applies the same scale before backward, and
updates it from the reducer's found_inf, which is identical on every rank, so the
ranks never drift apart (GradScaler under uneven inputs can: pytorch#90057).
"""

from dataclasses import dataclass

import torch

PRECISIONS = ("fp32", "fp16", "bf16")


def precision_for_capability(capability: tuple[int, int] | None) -> str:
    """The compute precision policy for a CUDA compute capability (None: a CPU):
    "fp32", "fp16" (with a loss scale) or "bf16". The trainer and the planner both
    decide by this one rule."""
    if capability is None:
        return "fp32"
    if tuple(capability) >= (8, 0):
        return "bf16"
    return "fp16"


AUTOCAST_DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def compute_precision(device: torch.device, requested: str = "auto") -> str:
    """The precision `device` computes in: the policy's for its generation ("auto"),
    or the one requested. bf16 on a GPU without bf16 arithmetic (before sm_80) is a
    ValueError naming the GPU."""
    if requested not in ("auto", *PRECISIONS):
        raise ValueError(f"precision {requested!r}: expected auto or one of {', '.join(PRECISIONS)}")
    capability = tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None
    if requested == "auto":
        return precision_for_capability(capability)
    if requested == "bf16" and capability is not None and capability < (8, 0):
        raise ValueError(f"--precision bf16: {torch.cuda.get_device_name(device)} (sm_{capability[0]}{capability[1]}) "
                         f"has no bf16 arithmetic (sm_80 and newer do); use fp16, with its loss scale, or fp32")
    return requested


@dataclass
class DynamicLossScaler:
    """GradScaler's schedule (start 2^16, x2 after 2000 clean steps, x0.5 on overflow),
    driven by an overflow verdict every rank shares."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    clean_steps: int = 0

    def __post_init__(self):
        if not (self.scale > 0 and self.growth_factor > 1 and 0 < self.backoff_factor < 1
                and self.growth_interval >= 1 and self.min_scale > 0):
            raise ValueError(f"DynamicLossScaler: invalid settings {self}")

    def update(self, found_inf: bool) -> None:
        """After a step: back off on overflow (the step was skipped), grow after a run
        of clean steps."""
        if found_inf:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
