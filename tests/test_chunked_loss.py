"""The loss chunk by chunk (hetcomm.train.chunked_loss): its loss and gradients against
float64 within a bound counted from the computation, the vocabulary-wide tensors it does
not keep, the models' use of it under checkpointing, and bad inputs refused by name."""

import pytest
import torch
import torch.nn.functional as F
from tolerances import UNIT_ROUNDOFF, gamma

from hetcomm.train.chunked_loss import LOSS_CHUNK_LOGIT_BYTES, chunked_cross_entropy, loss_chunk_tokens
from hetcomm.train.llama import Llama, LlamaConfig
from hetcomm.train.model import GPT, GPTConfig

TOKENS, WIDTH, VOCAB = 60, 16, 50
U = UNIT_ROUNDOFF[torch.float32]


def inputs(seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(6, TOKENS // 6, WIDTH, generator=generator)
    weight = torch.randn(VOCAB, WIDTH, generator=generator) * 0.5
    targets = torch.randint(0, VOCAB, (6, TOKENS // 6), generator=generator)
    return hidden, weight, targets


def computed(hidden, weight, targets, reduction, chunk_tokens=None, plain=False):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    if plain:
        loss = F.cross_entropy(F.linear(hidden, weight).double().flatten(0, 1), targets.flatten(), reduction=reduction)
    else:
        loss = chunked_cross_entropy(hidden, weight, targets, reduction, chunk_tokens)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


def bounds(hidden, weight, targets, reduction):
    """Absolute bounds of the fp32 loss and gradients against float64, counted per token:
    each logit a dot product of WIDTH terms (gamma(WIDTH) of its terms' magnitudes, M);
    the log-sum-exp 1-Lipschitz in the logits, with its exps, sum of VOCAB terms and log
    within gamma(VOCAB + 8) of 1 + its magnitude; the loss a sum of TOKENS terms; the
    softmax's probabilities within their own size times twice a token's error (a shift
    of the logits and of the log-sum-exp) and 4 roundings; each gradient a sum over the
    vocabulary (of hidden) or over the tokens (of weight) of such products."""
    h, w = hidden.double().flatten(0, 1), weight.double()
    t = targets.flatten()
    z = h @ w.T
    magnitude = h.abs() @ w.abs().T
    per_token = F.cross_entropy(z, t, reduction="none")
    error = 2 * gamma(WIDTH) * magnitude.max(1).values \
        + gamma(VOCAB + 8) * (1 + per_token.abs() + z.abs().max(1).values)
    loss = error.sum() + gamma(TOKENS) * per_token.abs().sum()
    residual = torch.softmax(z, 1) - F.one_hot(t, VOCAB).double()
    probability_error = torch.softmax(z, 1) * (2 * error + 4 * U)[:, None] + U * residual.abs()
    hidden_grad = probability_error @ w.abs() + gamma(VOCAB) * (residual.abs() @ w.abs())
    weight_grad = probability_error.T @ h.abs() + gamma(TOKENS) * (residual.abs().T @ h.abs())
    scale = 1 / TOKENS if reduction == "mean" else 1
    return (loss * scale + U * per_token.abs().sum() * scale, hidden_grad.view_as(hidden) * scale,
            weight_grad * scale)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("chunk_tokens", [7, 16, 60, None])
def test_the_loss_and_its_gradients_are_float64_s_within_their_rounding(reduction, chunk_tokens):
    hidden, weight, targets = inputs()
    loss, hidden_grad, weight_grad = computed(hidden, weight, targets, reduction, chunk_tokens)
    exact = computed(hidden.double(), weight.double(), targets, reduction, plain=True)
    loss_bound, hidden_bound, weight_bound = bounds(hidden, weight, targets, reduction)
    assert loss.dtype == torch.float32
    assert abs(loss.double() - exact[0]) <= loss_bound
    assert ((hidden_grad.double() - exact[1]).abs() <= hidden_bound).all()
    assert ((weight_grad.double() - exact[2]).abs() <= weight_bound).all()
    # A chunk lost or counted twice lands a whole token's loss away: far beyond the bound.
    assert exact[0] / (TOKENS if reduction == "mean" else 1) > 100 * loss_bound


def test_a_single_chunk_is_torch_s_cross_entropy_bit_for_bit():
    hidden, weight, targets = inputs(1)
    chunked = computed(hidden, weight, targets, "sum", chunk_tokens=TOKENS)
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    plain = F.cross_entropy(F.linear(hidden, weight).float().flatten(0, 1), targets.flatten(), reduction="sum")
    plain.backward()
    assert torch.equal(chunked[0], plain.detach())
    assert torch.equal(chunked[1], hidden.grad) and torch.equal(chunked[2], weight.grad)


def kept_vocabulary_wide(chunk_tokens):
    """The bytes autograd keeps from the forward in tensors as wide as the vocabulary."""
    hidden, weight, targets = inputs(2)
    hidden.requires_grad_()
    kept = []

    def pack(tensor):
        if tensor.dim() and tensor.shape[-1] == VOCAB and tensor.dtype.is_floating_point and tensor is not weight:
            kept.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        chunked_cross_entropy(hidden, weight, targets, "sum", chunk_tokens)
    return sum(kept)


def test_chunks_keep_no_logits_from_the_forward():
    assert kept_vocabulary_wide(TOKENS) >= TOKENS * VOCAB * 4   # one chunk: the fp32 log-softmax at least
    assert kept_vocabulary_wide(8) == 0


def test_a_chunk_holds_the_rule_s_bytes_of_fp32_logits():
    assert loss_chunk_tokens(128256) == LOSS_CHUNK_LOGIT_BYTES // (4 * 128256) == 261
    assert loss_chunk_tokens(50257) * 4 * 50257 <= LOSS_CHUNK_LOGIT_BYTES < (loss_chunk_tokens(50257) + 1) * 4 * 50257
    assert loss_chunk_tokens(LOSS_CHUNK_LOGIT_BYTES) == 1


@pytest.mark.parametrize("model", [
    GPT(GPTConfig(vocab_size=VOCAB, block_size=10, n_layer=2, n_head=2, n_embd=WIDTH)),
    Llama(LlamaConfig(vocab_size=VOCAB, block_size=10, n_layer=2, n_head=2, n_kv_head=1, n_embd=WIDTH,
                      intermediate=32)),
], ids=["gpt", "llama"])
def test_a_checkpointed_model_computes_its_loss_chunk_by_chunk(model):
    _, _, targets = inputs(3)
    tokens = targets.roll(1)
    final = model.ln_f if isinstance(model, GPT) else model.norm
    seen = []
    final.register_forward_hook(lambda module, args, output: seen.append(output.detach()))
    model.checkpointing, model.loss_chunk_tokens = True, 8
    logits, loss = model(tokens, targets, reduction="sum")
    assert logits is None
    assert torch.equal(loss, chunked_cross_entropy(seen[0], model.head.weight, targets, "sum", 8))
    with torch.no_grad():   # no backward to save memory for: logits as always
        assert model(tokens, targets)[0].shape == (*targets.shape, VOCAB)


@pytest.mark.parametrize("change, message", [
    ({"reduction": "none"}, r"reduction 'none': expected one of mean, sum"),
    ({"weight": torch.zeros(VOCAB, WIDTH + 1)}, r"weight of shape \(50, 17\): expected \(vocabulary, 16\)"),
    ({"targets": torch.zeros(6, 9, dtype=torch.long)}, r"targets of shape \(6, 9\): expected \(6, 10\)"),
    ({"chunk_tokens": 0}, r"chunk_tokens must be at least 1; got 0"),
])
def test_bad_input_is_refused_by_name(change, message):
    hidden, weight, targets = inputs()
    arguments = {"hidden": hidden, "weight": weight, "targets": targets, **change}
    with pytest.raises(ValueError, match=message):
        chunked_cross_entropy(**arguments)
