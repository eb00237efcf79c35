"""Causal-language-model training of a Hugging Face GPT-2, balanced across ranks of
different speeds by hetcomm.loop.

    python examples/hf_gpt2.py                          # 4 simulated CPU workers, a tiny GPT-2
    python examples/hf_gpt2.py --size gpt2 --steps 5 --seq 256
    torchrun --nproc-per-node 4 examples/hf_gpt2.py --size gpt2

The model is built from a config (no weights are downloaded): "tiny", or "gpt2" with
GPT-2 small's shape (124M parameters, its 50257-token vocabulary). The data is
Python's standard-library sources as bytes. Every sample has seq - 1 predicted
tokens, so the loop is told so (items_per_sample) and the step's weights are known
before the reduction. Needs transformers: pip install 'hetcomm[hf]'.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (BYTE_VOCAB, CLS, SEP, CausalLMSamples, StepLog, cluster_arguments,  # noqa: E402
                    require_transformers, simulated_speed)

from hetcomm.loop import BalancedLoop  # noqa: E402
from hetcomm.loop.launch import launch  # noqa: E402

SIZES = {"tiny": {"vocab_size": BYTE_VOCAB, "n_embd": 64, "n_layer": 2, "n_head": 2},
         "gpt2": {"vocab_size": 50257}}   # GPT2Config's defaults are GPT-2 small's shape


def build_model(size: str, seq: int, dropout: float):
    transformers = require_transformers()
    config = transformers.GPT2Config(**SIZES[size], n_positions=max(1024, seq), bos_token_id=CLS, eos_token_id=SEP,
                                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    model = transformers.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"   # its default, named (transformers warns when the model names none)
    return model


def train(rank: int, world: int, device: torch.device, args, split=None, state=None):
    """Trains on this rank; returns every step's loss and the model (and the loop)."""
    torch.manual_seed(args.seed)   # the same initial weights on every rank
    model = build_model(args.size, args.seq, args.dropout).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    loop = BalancedLoop(model, CausalLMSamples(args.seq), global_batch=args.global_batch, split=split,
                        balance=args.balance,
                        items_per_sample=args.seq - 1, seed=args.seed,
                        wire_dtype=torch.float32 if device.type == "cpu" else torch.float16,
                        simulated_speed=simulated_speed(rank, world, device, args),
                        probe_forward=lambda batch: model(**batch).loss)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loop.load_state_dict(state["loop"])
    losses, log = [], StepLog(args.log_json, rank)
    for step in loop.steps(args.steps):
        for batch in step:
            with loop.autocast():
                loss = model(**batch).loss   # the mean over the micro-batch's predicted tokens
            step.backward(loss)
        result = step.reduce()
        if not result.skipped:
            result.clip_grad_norm_(1.0)
            optimizer.step()
        losses.append(result.loss)
        log.record(result)
        if rank == 0 and args.log:
            print(f"step {result.number:4d}  loss {result.loss:.4f}  split {'/'.join(map(str, result.split))}",
                  flush=True)
    return losses, model, (optimizer, loop)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--no-log", dest="log", action="store_false")
    cluster_arguments(p)
    return p


def main(rank: int, world: int, device: torch.device, args) -> None:
    train(rank, world, device, args)


if __name__ == "__main__":
    arguments = parser().parse_args()
    require_transformers()
    launch(main, arguments, nproc=arguments.nproc)
