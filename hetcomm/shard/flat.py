"""The model's trained parameters and their gradients as views into two flat buffers.

Sharding works on ranges of one flat element space: an owner's range of the gradients
is reduced to it in place, its optimizer step writes the new weights straight into the
flat weight buffer, and the all-gather sends ranges of that same buffer. Making every
parameter (and its .grad) a view of the buffers costs no memory beyond the model's own
and no copy per step. Autograd accumulates into an existing .grad in place, so the
views survive backward; a .grad that something replaced (a zero_grad that set it to
None, an assignment) is put back into its view at the next step."""

from dataclasses import dataclass

import torch
from torch import Tensor

from hetcomm.comm.collectives import layout_fingerprint


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of the flat space, all of parameter `index`."""

    index: int
    start: int
    stop: int


class FlatParameters:
    """Flattens `params` (trained parameters, in order, of one dtype and device) into
    `weights`, with `grads` beside it; each parameter and its .grad become views.
    whole_grads=False: no flat gradient (streamed gradients live one layer at a time,
    hetcomm.shard.streamed)."""

    def __init__(self, params: list[torch.nn.Parameter], who: str, whole_grads: bool = True):
        if not params:
            raise ValueError(f"{who}: no parameter requires grad")
        first = params[0]
        for i, p in enumerate(params):
            if p.dtype != first.dtype or p.device != first.device:
                raise ValueError(f"{who}: trained parameter {i} is {p.dtype} on {p.device}, parameter 0 "
                                 f"{first.dtype} on {first.device}; sharding keeps every trained parameter in one "
                                 f"flat buffer: cast and move the whole model first (model.half().to(device))")
            if not p.dtype.is_floating_point:
                raise ValueError(f"{who}: trained parameter {i} is {p.dtype}; expected a float dtype")
        self.params = params
        self.dtype, self.device = first.dtype, first.device
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.total = self.offsets[-1]
        self.weights: Tensor | None = torch.empty(self.total, dtype=self.dtype, device=self.device)
        self.sharded = None   # hetcomm.shard.weights.ShardedWeights, once the weights are sharded too
        self.grads = torch.zeros(self.total, dtype=self.dtype, device=self.device) if whole_grads else None
        self._grad_views = [] if self.grads is None else \
            [self.grads[a:b].view(p.shape) for p, a, b in zip(params, self.offsets, self.offsets[1:])]
        with torch.no_grad():
            for p, view in zip(params, self.weight_views()):
                view.copy_(p.detach())
                p.data = view
        self.attach_grads()

    def weight_views(self) -> list[Tensor]:
        return [self.weights[a:b].view(p.shape) for p, a, b in zip(self.params, self.offsets, self.offsets[1:])]

    def weights_of(self, start: int, stop: int) -> Tensor:
        """The flat weights [start, stop): a view of the whole buffer, or of this rank's
        own range once the weights are sharded (hetcomm.shard.weights)."""
        if self.sharded is not None:
            return self.sharded.local_slice(start, stop)
        return self.weights[start:stop]

    def attach_grads(self) -> None:
        """Points every .grad at its view, keeping the values of one that was replaced.
        An identity check per parameter: it runs at every step."""
        for p, view in zip(self.params, self._grad_views):
            grad = p.grad
            if grad is view:
                continue
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad)
            p.grad = view

    def zero_grads(self) -> None:
        """Zeros every gradient, keeping the views (instead of model.zero_grad())."""
        if self.grads is None:
            for p in self.params:
                p.grad = None
            return
        self.grads.zero_()
        self.attach_grads()

    def pieces(self, start: int, stop: int) -> list[Piece]:
        """The parameter pieces of flat elements [start, stop), in order."""
        found = []
        for i, (a, b) in enumerate(zip(self.offsets, self.offsets[1:])):
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                found.append(Piece(i, lo, hi))
        return found

    def digest(self) -> str:
        """What identifies the flat space: the count, order, shapes and dtype of the
        parameters (a checkpoint of another model has another), as the reducer's layout
        check digests them."""
        return f"{layout_fingerprint(self.params):016x}"
