"""The language model's loss without its vocabulary-wide logits for every token at once.

`F.cross_entropy(head(hidden).float(), targets)` keeps, per token, the fp32 log-softmax
(4 bytes a vocabulary entry) from the forward to the backward, and the backward adds the
gradients of the log-softmax and of the logits (8 more): for Llama-3.2's vocabulary of
128,256 at 2,048 tokens that is 3 GiB for one sample, more than its 16 blocks' activations
when they are checkpointed. Here the tokens go through the head and the loss a chunk at a
time, each chunk under torch's non-reentrant checkpoint: the forward keeps only the
chunk's hidden states (a view of the head's input, kept anyway) and its summed loss, and
the backward recomputes one chunk's logits at a time. The cost is one more forward of the
head (a third of its forward and backward); the logits are never returned.

The chunk holds at most LOSS_CHUNK_LOGIT_BYTES of fp32 logits; hetcomm.plan.full_shard
counts a checkpointed card's loss with the same rule."""

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

LOSS_CHUNK_LOGIT_BYTES = 128 * 2**20
REDUCTIONS = ("mean", "sum")


def loss_chunk_tokens(vocab_size: int) -> int:
    """The tokens of one chunk: as many as LOSS_CHUNK_LOGIT_BYTES of fp32 logits hold."""
    return max(1, LOSS_CHUNK_LOGIT_BYTES // (4 * vocab_size))


def _summed_loss(hidden, weight, targets):
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          reduction: str = "mean", chunk_tokens: int | None = None) -> torch.Tensor:
    """The cross-entropy of the bias-free head `weight` (vocabulary x width) applied to
    `hidden` (..., width) against `targets` (the same leading shape), in fp32, as
    F.cross_entropy(F.linear(hidden, weight).float(), targets) computes it, chunk by chunk
    of `chunk_tokens` tokens (default loss_chunk_tokens of the vocabulary)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction {reduction!r}: expected one of {', '.join(REDUCTIONS)}")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight of shape {tuple(weight.shape)}: expected (vocabulary, {hidden.shape[-1]}), "
                         f"the width of hidden {tuple(hidden.shape)}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets of shape {tuple(targets.shape)}: expected {tuple(hidden.shape[:-1])}, "
                         f"hidden's shape without its width")
    if chunk_tokens is None:
        chunk_tokens = loss_chunk_tokens(weight.shape[0])
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1; got {chunk_tokens}")
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1)
    tokens = targets.numel()
    if tokens <= chunk_tokens:
        total = _summed_loss(hidden, weight, targets)
    else:
        total = sum(checkpoint(_summed_loss, hidden[start:start + chunk_tokens], weight,
                               targets[start:start + chunk_tokens], use_reentrant=False)
                    for start in range(0, tokens, chunk_tokens))
    return total / tokens if reduction == "mean" else total


def head_and_loss(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor | None, reduction: str,
                  checkpointing: bool, chunk_tokens: int | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """What GPT's and Llama's forward return from their final hidden states: (logits,
    loss), the loss None without targets; checkpointing (with autograd on), the loss a
    chunk at a time and no logits."""
    if targets is not None and checkpointing and torch.is_grad_enabled():
        return None, chunked_cross_entropy(hidden, head.weight, targets, reduction, chunk_tokens)
    logits = head(hidden)
    if targets is None:
        return logits, None
    return logits, F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), reduction=reduction)
