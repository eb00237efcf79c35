"""The planner's per-sample counts against the model the trainer really builds:
parameters exactly, FLOPs against PyTorch's FlopCounterMode, and the activation bytes
kept for backward against autograd's saved tensors, in fp32 and under autocast."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from hetcomm.plan.model_shape import PRESETS, ModelShape, parse_model
from hetcomm.train.model import GPT, GPTConfig

SHAPES = [(2, 4, 64, 256, 32), (3, 2, 96, 1000, 64)]   # layers, heads, width, vocabulary, sequence
BATCH = 4


def build(layers, heads, width, vocab, seq):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=width))
    tokens = torch.randint(0, vocab, (BATCH, seq))
    return model, tokens, ModelShape("test", layers, heads, width, vocab)


@pytest.mark.parametrize("dims", SHAPES)
def test_parameters_are_exact(dims):
    model, _, shape = build(*dims)
    assert shape.parameters(dims[4]) == sum(p.numel() for p in model.parameters())


def test_gpt2_presets_have_their_published_sizes():
    assert PRESETS["gpt2-124m"].parameters(1024) == pytest.approx(124.4e6, rel=1e-3)
    assert PRESETS["gpt2-355m"].parameters(1024) == pytest.approx(354.8e6, rel=1e-3)
    assert PRESETS["gpt2-774m"].parameters(1024) == pytest.approx(774.0e6, rel=1e-3)
    assert PRESETS["gpt2-1.5b"].parameters(1024) == pytest.approx(1557.6e6, rel=1e-3)


@pytest.mark.parametrize("dims", SHAPES)
def test_flops_match_the_counted_matmuls(dims):
    model, tokens, shape = build(*dims)
    # The math backend runs attention as matmuls, which the counter sees; biases and
    # norms (6 FLOPs per parameter in the formula) are the rest of the difference.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        _, loss = model(tokens, tokens, reduction="sum")
        loss.backward()
    assert shape.flops_per_sample(dims[4]) == pytest.approx(counter.get_total_flops() / BATCH, rel=0.02)


def saved_bytes(model, tokens, autocast: bool) -> float:
    """Bytes autograd keeps for backward, per sample: distinct storages, leaving out the
    parameters and autocast's 16-bit weight copies (the planner counts those as state)."""
    storages = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    shapes |= {shape[::-1] for shape in shapes}   # linear layers may save the transposed weight

    def keep(tensor):
        weight_copy = tensor.dtype == torch.bfloat16 and tuple(tensor.shape) in shapes
        if tensor.untyped_storage().data_ptr() not in weights and not weight_copy:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
            torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        model(tokens, tokens, reduction="sum")
    return sum(storages.values()) / BATCH


@pytest.mark.parametrize("dims", SHAPES)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_kept_activations_match_autograds_saved_tensors(dims, precision):
    model, tokens, shape = build(*dims)
    measured = saved_bytes(model, tokens, autocast=precision != "fp32")
    assert shape.saved_bytes_per_sample(dims[4], precision) == pytest.approx(measured, rel=0.1)
    # The peak adds the loss's fp32 gradients: 8 bytes per vocabulary entry and token.
    extra = shape.activation_bytes_per_sample(dims[4], precision) - shape.saved_bytes_per_sample(dims[4], precision)
    assert extra == 8 * dims[3] * dims[4]


def test_custom_models_and_bad_model_strings():
    shape = parse_model("layers=3,heads=2,dim=64,vocab=100")
    assert (shape.n_layer, shape.n_head, shape.n_embd, shape.vocab_size) == (3, 2, 64, 100)
    assert parse_model("GPT2-124M") is PRESETS["gpt2-124m"]
    for text, message in [("gpt5", "unknown model; expected one of gpt2-124m"),
                          ("layers=2,heads=2", "missing dim="),
                          ("layers=2,heads=2,dim=x", "'dim=x' is not one of"),
                          ("layers=2,heads=3,dim=64", "not a multiple of heads"),
                          ("layers=0,heads=1,dim=8", "n_layer = 0")]:
        with pytest.raises(ValueError, match=message):
            parse_model(text)


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("fp16", torch.float16)])
def test_eager_attention_score_bytes_match_autograds_saved_tensors(precision, dtype):
    # BERT-era attention as separate kernels: scores, softmax (in fp32: CUDA autocast's
    # fp32 list has it), dropout on the probabilities (native_dropout, the kernel CUDA
    # runs, which keeps a 1-byte mask), then the value product, in 16-bit under autocast;
    # what autograd keeps of the seq×seq scores.
    heads, head_dim, seq = 4, 16, 48
    shape = ModelShape("eager", 1, heads, heads * head_dim, 100, "bert", "qa")
    q, k, v = (torch.randn(BATCH, heads, seq, head_dim, dtype=dtype, requires_grad=True) for _ in range(3))
    storages = {}

    def keep(tensor):
        if tuple(tensor.shape[-2:]) == (seq, seq):
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        probabilities = torch.softmax((q @ k.transpose(-1, -2) / head_dim**0.5).float(), dim=-1)
        torch.native_dropout(probabilities, 0.1, True)[0].to(dtype) @ v
    assert sum(storages.values()) == shape.score_bytes_per_token(seq, precision) * seq * BATCH
