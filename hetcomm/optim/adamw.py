"""AdamW on fp32 master weights, stepped by hetcomm.adamw_: per element one pass from
the gradient (fp16, bf16 or fp32, times a device-side multiplier) through the master
and both moments to the master's 16-bit copy in the model.

It is a torch.optim.Optimizer: parameter groups, torch.optim.lr_scheduler, zero_grad
and a state_dict of torch.optim.AdamW's layout (a torch AdamW state loads into it, and
its state into a torch AdamW). The update is torch.optim.AdamW's (decoupled weight
decay) within fp32 rounding. What torch's lacks for mixed precision: the gradient's
unscale and clipping factor and the overflow skip are device tensors passed to step(),
so nothing waits for the GPU, and the skip leaves the step count as it was."""

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from hetcomm import ops


class AdamW(torch.optim.Optimizer):
    """AdamW over fp32 parameters (a 16-bit model's masters), fused.

    Args:
        params: float32 tensors or parameter groups, as for torch.optim.AdamW.
        lr, betas, eps, weight_decay: as torch.optim.AdamW's (weight_decay 1e-2).
        copies: one tensor per parameter (in the order of the groups' parameters), of
            any float dtype and the same number of elements: each step writes the new
            values there, rounded to nearest-even (the 16-bit model's weights).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, copies: Sequence[Tensor] | None = None):
        _check_hyper(lr, betas, eps, weight_decay)
        # The keys of torch's AdamW too, so that a state dict goes either way.
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "amsgrad": False,
                    "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
                    "fused": None}
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.float32:
                    raise TypeError(f"hetcomm.optim.AdamW: a parameter has dtype {p.dtype}; expected torch.float32 "
                                    f"(keep fp32 masters of a 16-bit model and pass the model's weights as copies)")
        self.copies: dict[Tensor, Tensor] = {}
        if copies is not None:
            self.set_copies(copies)

    def set_copies(self, copies: Sequence[Tensor]) -> None:
        """Where each step writes each parameter's new value (see the class)."""
        params = [p for group in self.param_groups for p in group["params"]]
        if len(copies) != len(params):
            raise ValueError(f"hetcomm.optim.AdamW: copies has {len(copies)} tensors but the groups hold "
                             f"{len(params)} parameters; expected one per parameter")
        for i, (p, c) in enumerate(zip(params, copies)):
            if c.numel() != p.numel():
                raise ValueError(f"hetcomm.optim.AdamW: copies[{i}] has {c.numel()} elements but its parameter "
                                 f"has {p.numel()}; expected as many")
        self.copies = dict(zip(params, copies))

    def add_param_group(self, param_group: dict) -> None:
        for key in ("amsgrad", "maximize"):
            if param_group.get(key):
                raise ValueError(f"hetcomm.optim.AdamW: {key}=True is not supported; use torch.optim.AdamW")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: Tensor | float = 1.0, found_inf: Tensor | None = None):
        """One step of every parameter with a gradient. grad_scale: what the gradients are
        multiplied by first (1 / loss scale, a clipping coefficient: a 1-element float32
        device tensor, or a float). found_inf: a 1-element float32 device tensor; when
        non-zero, nothing changes, step counts included."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])
            for key in ("amsgrad", "maximize"):
                if group.get(key):
                    raise ValueError(f"hetcomm.optim.AdamW: {key}=True is not supported; use torch.optim.AdamW")
            by_device: dict[torch.device, list[Tensor]] = {}
            for p in group["params"]:
                if p.grad is not None:
                    by_device.setdefault(p.device, []).append(p)
            for device, params in by_device.items():
                self._step_group(group, params, device, grad_scale, found_inf)
        return loss

    def _step_group(self, group: dict, params: list[Tensor], device: torch.device, grad_scale, found_inf) -> None:
        skip = torch.zeros(1, device=device) if found_inf is None else found_inf.to(device)
        if not isinstance(grad_scale, Tensor):
            grad_scale = torch.full((1,), float(grad_scale), device=device)
        steps = []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif state["step"].device != device:   # a torch AdamW's state keeps it on the CPU
                state["step"] = state["step"].to(device)
            steps.append(state["step"])
        # Every parameter of a group has taken the same steps (torch's AdamW counts them
        # apiece too): one count serves the op, and each is moved on unless skipped.
        torch._foreach_add_(steps, 1.0 - (skip != 0).float().reshape(()))
        copies = [self.copies[p] for p in params] if self.copies else []
        beta1, beta2 = group["betas"]
        if not _has_kernel(device):
            self._step_unfused(group, params, steps, copies, grad_scale.to(device), skip)
            return
        ops.adamw_([p.grad for p in params], params, [self.state[p]["exp_avg"] for p in params],
                   [self.state[p]["exp_avg_sq"] for p in params], copies, grad_scale=grad_scale.to(device),
                   found_inf=skip, step=steps[0].reshape(1), lr=group["lr"], beta1=beta1, beta2=beta2,
                   eps=group["eps"], weight_decay=group["weight_decay"])


    def _step_unfused(self, group: dict, params: list[Tensor], steps: list[Tensor], copies: list[Tensor],
                      grad_scale: Tensor, skip: Tensor) -> None:
        """The same step where this build has no adamw_ kernel for the device (CUDA tensors
        with a CPU-only build, a pure-Python install): torch's fused AdamW on fp32
        gradients (it divides by its grad_scale), then the copies. Within fp32 rounding of
        adamw_, in three passes."""
        beta1, beta2 = group["betas"]
        grads = [p.grad if p.grad.dtype == torch.float32 else p.grad.float() for p in params]
        torch._fused_adamw_(params, grads, [self.state[p]["exp_avg"] for p in params],
                            [self.state[p]["exp_avg_sq"] for p in params], [], steps, lr=group["lr"], beta1=beta1,
                            beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False,
                            maximize=False, grad_scale=1.0 / grad_scale, found_inf=skip)
        if copies:
            torch._foreach_copy_(copies, params)


def _has_kernel(device: torch.device) -> bool:
    """Whether this build has an adamw_ kernel for the device's tensors. A pure-Python
    install has only the reference (several passes per element): torch's fused AdamW
    and a cast are faster there, and give the same step within fp32 rounding."""
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device.type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key("hetcomm::adamw_", key)


def _check_hyper(lr, betas, eps, weight_decay) -> None:
    """torch.optim.AdamW's checks, with NaN and inf refused too."""
    if isinstance(lr, Tensor) or not 0.0 <= lr < float("inf"):
        raise ValueError(f"hetcomm.optim.AdamW: lr = {lr!r}; expected a finite float >= 0")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"hetcomm.optim.AdamW: betas = {betas!r}; expected two floats in [0, 1)")
    if not 0.0 <= eps < float("inf"):
        raise ValueError(f"hetcomm.optim.AdamW: eps = {eps!r}; expected a finite float >= 0")
    if not 0.0 <= weight_decay < float("inf"):
        raise ValueError(f"hetcomm.optim.AdamW: weight_decay = {weight_decay!r}; expected a finite float >= 0")
