"""hetcomm.train.llama's Llama-style decoder: its parameters are what the planner counts
(hetcomm.plan.llama_shape), it computes what transformers' LlamaForCausalLM computes
with the same weights, within rounding; and `hetcomm train --arch llama` trains it on
Gloo ranks of speeds 1, 1, 0.5 and 0.25 fully sharded, under budgets its unsharded state
would not fit, as the unsharded run does: with and without activation checkpointing,
with the optimizer state offloaded."""

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks, values
from test_train_full_shard import run_full
from test_train_shard import PARTS
from test_trainer import tiny_config
from tolerances import UNIT_ROUNDOFF, farthest, order_bound

from hetcomm.shard.layout import bytes_needed
from hetcomm.train.config import from_args, parser, validate
from hetcomm.train.llama import Llama, LlamaConfig, default_intermediate, hf_config_kwargs, hf_name, \
    load_hf_state_dict
from hetcomm.train.trainer import build_model, model_config, run_description

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


# --- hetcomm train --arch llama ----------------------------------------------------------

SPEEDS = "1,1,0.5,0.25"
STEPS = 20
LLAMA = dict(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, steps=STEPS, global_batch=16,
             precision="fp32", wire="float32", equal_steps=0, speeds=SPEEDS)


def llama_config(tmp_path, **changes):
    return tiny_config(tmp_path, **{**LLAMA, **changes})


def elements(config) -> int:
    return sum(p.numel() for p in build_model(config, 256).parameters())   # byte data: 256 tokens


def budgets(config) -> tuple[str, int]:
    """--state-memory for --shard full: the device bytes of ranges in 11/11/11/32 parts of
    the model (a tenth spare; fp32 weights, gradients' sum, AdamW's moments, the scratch of
    the owner's checks: hetcomm.shard.layout.bytes_needed), and the bytes of the unsharded
    model's state: fp32 weights, gradients and AdamW's two moments, 16 bytes an element."""
    count = elements(config)
    memory = [bytes_needed(math.ceil(1.1 * count * part / sum(PARTS)), torch.float32, 2**30, weights=True,
                           streamed=True) for part in PARTS]
    return ",".join(map(str, memory)), 16 * count


def test_a_llama_trains_fully_sharded_as_unsharded_with_checkpointing_and_offload(tmp_path):
    plain_config = llama_config(tmp_path, split="1,3,5,7")
    memory, unsharded = budgets(plain_config)
    per_rank = [int(m) for m in memory.split(",")]
    # The model fits a rank only fully sharded: each budget is below the unsharded state,
    # and the smaller ones below its weights and gradients alone (--shard state keeps both whole).
    assert max(per_rank) < unsharded and min(per_rank) < unsharded // 2
    plain = values(run_ranks(4, run_full, replace(plain_config, out=str(tmp_path / "p")), tmp_path=tmp_path / "p"))
    twin = values(run_ranks(4, run_full, llama_config(tmp_path, split="7,5,3,1", out=str(tmp_path / "t")),
                            tmp_path=tmp_path / "t"))
    reference = plain[0][0]
    print(f"the reordered twin: {farthest([twin[0][0]], [reference]):.3g} from the unsharded run")
    assert len(reference) == STEPS and reference[-1] < 0.8 * reference[0]   # it learns
    bound = order_bound([reference], [[twin[0][0]]])
    for name, changes in {"full": {}, "checkpointing": {"checkpointing": "on"},
                          "offload": {"offload": "optimizer"}}.items():
        config = replace(plain_config, shard="full", state_memory=memory, out=str(tmp_path / name), **changes)
        validate(config, 4)
        full = values(run_ranks(4, run_full, config, tmp_path=tmp_path / name))
        distance = farthest([full[0][0]], [reference])
        print(f"{name}: {distance:.3g} from the unsharded run (bound {bound:.3g})")
        assert distance <= bound, (name, full[0][0], reference, bound)
        for _, weights, held in full:
            assert all(torch.equal(a, b) for a, b in zip(weights, full[0][1]))   # the same model on every rank
            assert held["gathered"] == 0 and all(g is None for g in held["grads"])
            size = held["range"][1] - held["range"][0]
            assert held["local"] == 4 * size
            assert held["state"] == (0 if name == "offload" else 8 * size)
        sizes = [h["range"][1] - h["range"][0] for _, _, h in full]
        assert sum(sizes) == elements(plain_config) and sizes[3] > 2.5 * sizes[0]


def test_a_llama_trains_with_the_speeds_balanced(tmp_path):
    """The default balancing on speeds 1, 1, 0.5 and 0.25, checkpointing on the slow
    ranks: the splits change as it goes, the losses stay within order_bound of the equal
    split's."""
    config = llama_config(tmp_path, steps=8, shard="full", checkpointing="off,off,on,on", equal_steps=2)
    config = replace(config, state_memory=budgets(config)[0])
    balanced = values(run_ranks(4, run_full, config, tmp_path=tmp_path / "b"))[0][0]
    equal = values(run_ranks(4, run_full, llama_config(tmp_path, steps=8, split="4,4,4,4",
                                                       out=str(tmp_path / "e")), tmp_path=tmp_path / "e"))[0][0]
    twin = values(run_ranks(4, run_full, llama_config(tmp_path, steps=8, split="1,3,5,7",
                                                      out=str(tmp_path / "t")), tmp_path=tmp_path / "t"))[0][0]
    distance, bound = farthest([balanced], [equal]), order_bound([equal], [[twin]])
    print(f"balanced: {distance:.3g} from the equal split (bound {bound:.3g})")
    assert distance <= bound, (balanced, equal, bound)
    samples = [json.loads(line)["samples"] for line in (Path(config.out) / "steps.jsonl").read_text().splitlines()]
    assert samples[0] == [4, 4, 4, 4] and samples[-1][3] < 4 < samples[-1][0]   # the slowest rank got fewer


def test_the_command_line_shapes_a_llama_and_its_checkpoints_name_it(tmp_path):
    args = parser().parse_args(["--arch", "llama", "--n-layer", "3", "--n-head", "6", "--n-kv-head", "2",
                                "--n-embd", "48", "--intermediate", "96"])
    config = from_args(args)
    shape = model_config(config, 256)
    assert isinstance(shape, LlamaConfig) and (shape.n_layer, shape.n_head, shape.n_kv_head, shape.head_dim,
                                               shape.intermediate) == (3, 6, 2, 8, 96)
    assert isinstance(build_model(config, 256), Llama)
    assert from_args(parser().parse_args([])).arch == "gpt"
    # What a checkpoint must match: a Llama's shape; a GPT's as before --arch (its checkpoints resume).
    assert "arch" not in run_description(tiny_config(tmp_path), 4, "d", 10)
    described = run_description(llama_config(tmp_path), 4, "d", 10)
    assert (described["arch"], described["n_kv_head"], described["intermediate"]) == ("llama", 2, 128)


@pytest.mark.parametrize("changes, message", [
    ({"arch": "bert"}, r"--arch 'bert': expected one of gpt, llama"),
    ({"n_kv_head": 3}, r"--n-head 4 must be a multiple of --n-kv-head 3"),
    ({"n_kv_head": 0}, r"--n-kv-head must be at least 1; got 0"),
    ({"intermediate": 0}, r"--intermediate must be at least 1; got 0"),
    ({"n_head": 5}, r"--n-embd 32 must be a multiple of --n-head 5"),
    ({"n_embd": 24, "n_head": 8, "n_kv_head": 4}, r"--n-embd 24 / --n-head 8 = 3 channels a head: rotary "
                                                  r"positions need an even number"),
    ({"arch": "gpt", "n_kv_head": 2}, r"--n-kv-head shapes a Llama-style model; add --arch llama"),
    ({"arch": "gpt", "n_kv_head": None, "intermediate": 64}, r"--intermediate shapes a Llama-style model"),
])
def test_bad_llama_shapes_are_refused_by_name(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        validate(llama_config(tmp_path, **changes), 4)
