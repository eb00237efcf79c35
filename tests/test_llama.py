"""hetcomm.train.llama's Llama-style decoder: its parameters are what the planner counts
(hetcomm.plan.llama_shape), and it computes what transformers' LlamaForCausalLM computes
with the same weights, within rounding."""

import pytest
import torch
import torch.nn.functional as F
from tolerances import UNIT_ROUNDOFF

from hetcomm.train.llama import Llama, LlamaConfig, default_intermediate, hf_config_kwargs, hf_name, \
    load_hf_state_dict

SHAPES = {   # GQA (2 query heads a key/value head), plain multi-head, an untied head, one key/value head
    "gqa": LlamaConfig(vocab_size=97, block_size=32, n_layer=3, n_head=4, n_kv_head=2, n_embd=48),
    "mha": LlamaConfig(vocab_size=97, block_size=32, n_layer=2, n_head=4, n_embd=32, intermediate=80),
    "untied": LlamaConfig(vocab_size=61, block_size=32, n_layer=2, n_head=6, n_kv_head=3, n_embd=48,
                          tie_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-6),
    "mqa": LlamaConfig(vocab_size=61, block_size=32, n_layer=2, n_head=4, n_kv_head=1, n_embd=64, head_dim=8),
}


@pytest.mark.parametrize("name", SHAPES)
def test_parameters_are_the_planner_s(name):
    config = SHAPES[name]
    params = list(Llama(config).parameters())   # a tied head is the embedding's tensor, listed once
    shape = config.shape()
    assert sum(p.numel() for p in params) == shape.parameters()
    assert len(params) == shape.parameter_tensors()


def test_the_default_mlp_width():
    # 8/3 n_embd rounded up to a multiple of 64: Llama's convention with a small multiple (Llama-7B's
    # 256 makes 11008 of 4096)
    assert [default_intermediate(h) for h in (32, 48, 64, 96, 4096)] == [128, 128, 192, 256, 10944]


def run_both(name, dtype):
    """Our model and transformers' (the same weights), their logits, and the gradients of
    the same loss on those logits, by our names."""
    transformers = pytest.importorskip("transformers")
    config = SHAPES[name]
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config_kwargs(config),
                                                                attn_implementation="sdpa")).to(dtype)
    ours = Llama(config).to(dtype)
    load_hf_state_dict(ours, hf.state_dict())
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (3, config.block_size), generator=generator)
    targets = torch.randint(0, config.vocab_size, (3, config.block_size), generator=generator)
    ours_logits, ours_loss = ours(tokens, targets)
    ours_loss.backward()
    hf_logits = hf(tokens).logits
    F.cross_entropy(hf_logits.float().view(-1, config.vocab_size), targets.reshape(-1)).backward()
    hf_params = dict(hf.named_parameters())
    return ({"logits": ours_logits.detach(), **{n: p.grad for n, p in ours.named_parameters()}},
            {"logits": hf_logits.detach(), **{n: hf_params[hf_name(n)].grad for n, _ in ours.named_parameters()}},
            ours)


def allowance(tensor, depth, dtype, ulps_a_layer=8):
    """A few units in the last place a layer (the blocks and the head; twice for a gradient,
    which goes through them forward and back) of the tensor's largest magnitude: the
    distance two computations of it in `dtype` may differ by when only their rounding
    differs. An fp32 run keeps within it of the float64 computation (checked below)."""
    return ulps_a_layer * depth * UNIT_ROUNDOFF[dtype] * tensor.abs().max().item()


@pytest.mark.parametrize("name", SHAPES)
def test_it_computes_what_transformers_llama_computes(name):
    config = SHAPES[name]
    for dtype in (torch.float64, torch.float32):
        ours, hf, model = run_both(name, dtype)
        assert ours.keys() == hf.keys()
        for key in ours:
            depth = config.n_layer + 1 if key == "logits" else 2 * (config.n_layer + 1)
            bound = allowance(hf[key], depth, dtype)
            assert (ours[key] - hf[key]).abs().max().item() <= bound, (dtype, key)
            assert hf[key].abs().max().item() > 0, key
        if dtype == torch.float32:
            # The fp32 bound is fp32 rounding: the fp32 run is within it of the float64 computation.
            exact, _, _ = run_both(name, torch.float64)
            for key in ours:
                depth = config.n_layer + 1 if key == "logits" else 2 * (config.n_layer + 1)
                assert (ours[key].double() - exact[key]).abs().max().item() <= allowance(exact[key], depth, dtype)


def test_checkpointing_changes_nothing_and_a_block_uses_only_its_own_parameters():
    torch.manual_seed(0)
    model = Llama(SHAPES["gqa"])
    tokens = torch.randint(0, 97, (2, 32))
    grads = []
    for checkpointing in (False, True):
        model.zero_grad()
        model.checkpointing = checkpointing
        model(tokens, tokens)[1].backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    # every parameter of block i is under blocks.i (full sharding's unit)
    names = {n for n, _ in model.named_parameters()}
    assert {n.split(".")[1] for n in names if n.startswith("blocks.")} == {"0", "1", "2"}
    assert not any("rotary" in n or "cos" in n for n, _ in model.named_buffers())
