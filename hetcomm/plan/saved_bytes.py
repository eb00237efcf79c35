"""What a BERT built by Hugging Face transformers really keeps for backward: the bytes
of the distinct storages autograd saves during one training forward, counted with
torch.autograd.graph.saved_tensors_hooks — the measurement the planner's activation
counts (hetcomm.plan.model_shape) are checked against, on the CPU.

Two things are made to run as they do on a GPU, where the planner's figures apply:
dropout keeps a 1-byte mask (CUDA's fused dropout; the CPU's keeps a full-width float
mask), and under autocast the softmax runs in fp32 (it is on CUDA autocast's fp32 list,
not on the CPU's). Parameters, and autocast's 16-bit copies of them, are state, not
activations, and are left out. Needs the `hf` extra (transformers).
"""

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetcomm.plan.model_shape import ModelShape


@dataclass(frozen=True)
class SavedBytes:
    """Per sample, from a run at batch 2 less one at batch 1."""

    layer: float      # per transformer layer
    outside: float    # embeddings and head

    def total(self, n_layer: int) -> float:
        return n_layer * self.layer + self.outside


def _cuda_dropout(input, p=0.5, training=True, inplace=False):
    if not training or p == 0:
        return input
    return torch.native_dropout(input, p, True)[0]


@contextlib.contextmanager
def _as_on_a_gpu(autocast: bool):
    dropout, softmax = F.dropout, F.softmax

    def fp32_softmax(input, dim=None, _stacklevel=3, dtype=None):
        return softmax(input.float(), dim=dim)

    F.dropout = _cuda_dropout
    if autocast:
        F.softmax = fp32_softmax
    try:
        yield
    finally:
        F.dropout, F.softmax = dropout, softmax


class CompositeGELU(torch.nn.Module):
    """GELU as BERT's code wrote it until transformers 2.x: five elementwise ops, whose
    backward keeps three tensors where F.gelu keeps one."""

    def forward(self, x):
        return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def bert_saved_bytes(shape: ModelShape, n_layer: int, seq: int, batch: int, precision: str, attention: str,
                     gelu: str = "fused") -> int:
    """Bytes saved for backward by one training forward of a BertForQuestionAnswering of
    `shape`'s width, heads and vocabulary with n_layer layers, at `batch` × `seq`
    tokens; precision "fp32", "bf16"/"fp16" for autocast (bf16 on the CPU: the same
    2-byte storage), or "o2": the whole model cast to 16-bit, as apex's amp O2 runs it
    (softmax and LayerNorm in 16-bit too); attention "eager" or "fused" (SDPA without attention dropout,
    which the CPU's flash kernel then runs); gelu "fused" (F.gelu) or "composite" (CompositeGELU)."""
    from transformers import BertConfig, BertForQuestionAnswering

    config = BertConfig(vocab_size=shape.vocab_size, hidden_size=shape.n_embd, num_hidden_layers=n_layer,
                        num_attention_heads=shape.n_head, intermediate_size=4 * shape.n_embd,
                        attn_implementation="eager" if attention == "eager" else "sdpa")
    if attention != "eager":
        config.attention_probs_dropout_prob = 0.0
    torch.manual_seed(0)
    model = BertForQuestionAnswering(config).train()
    if gelu == "composite":
        for layer in model.bert.encoder.layer:
            layer.intermediate.intermediate_act_fn = CompositeGELU()
    if precision == "o2":
        model = model.to(torch.bfloat16)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    by_shape: dict[tuple, list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.dim() == 2:   # a linear layer may keep the weight's copy transposed
            by_shape.setdefault(tuple(p.shape), []).append(p)
            by_shape.setdefault(tuple(p.shape[::-1]), []).append(p.t())
    storages: dict[int, int] = {}
    autocast = precision not in ("fp32", "o2")

    def keep(tensor):
        pointer = tensor.untyped_storage().data_ptr()
        weight_copy = tensor.dtype == torch.bfloat16 and any(
            torch.equal(tensor, p.detach().to(torch.bfloat16)) for p in by_shape.get(tuple(tensor.shape), ()))
        if pointer not in weights and not weight_copy:
            storages[pointer] = tensor.untyped_storage().nbytes()
        return tensor

    tokens = torch.randint(0, shape.vocab_size, (batch, seq))
    positions = torch.zeros(batch, dtype=torch.long)
    with _as_on_a_gpu(autocast), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
            torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        model(input_ids=tokens, token_type_ids=torch.zeros_like(tokens), attention_mask=torch.ones_like(tokens),
              start_positions=positions, end_positions=positions)
    return sum(storages.values())


def measure_bert(shape: ModelShape, seq: int, precision: str, attention: str, gelu: str = "fused") -> SavedBytes:
    """Per sample: the layers' and the rest's saved bytes, from 1- and 2-layer models at
    batches 1 and 2 (every count is linear in both)."""
    def per_sample(n_layer):
        return (bert_saved_bytes(shape, n_layer, seq, 2, precision, attention, gelu)
                - bert_saved_bytes(shape, n_layer, seq, 1, precision, attention, gelu))

    one, two = per_sample(1), per_sample(2)
    return SavedBytes(layer=float(two - one), outside=float(one - (two - one)))
