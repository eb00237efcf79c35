"""Masked-language-model pre-training of a Hugging Face BERT (the task of HetSeq's
legacy-GPU study), balanced across ranks of different speeds by hetcomm.loop.

    python examples/hf_bert_mlm.py                      # 4 simulated CPU workers, a tiny BERT
    python examples/hf_bert_mlm.py --size base --steps 5 --seq 128
    torchrun --nproc-per-node 4 examples/hf_bert_mlm.py --size base --seq 128

The model is built from a config (no weights are downloaded): "tiny" for tests,
"small" (4 layers of 128) for the CPU benchmark, "base" with bert-base-uncased's shape (110M parameters, its 30522-token
vocabulary). The data is Python's standard-library sources as bytes, masked as BERT
masks. Needs transformers: pip install 'hetcomm[hf]'.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (BYTE_VOCAB, PAD, MaskedLMSamples, StepLog, cluster_arguments,  # noqa: E402
                    require_transformers, simulated_speed)

from hetcomm.loop import BalancedLoop  # noqa: E402
from hetcomm.loop.launch import launch  # noqa: E402

SIZES = {"tiny": {"vocab_size": BYTE_VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                  "intermediate_size": 256},
         "small": {"vocab_size": BYTE_VOCAB, "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                   "intermediate_size": 512},
         "base": {"vocab_size": 30522}}   # BertConfig's defaults are bert-base's shape


def build_model(size: str, seq: int, dropout: float):
    transformers = require_transformers()
    config = transformers.BertConfig(**SIZES[size], max_position_embeddings=max(512, seq), pad_token_id=PAD,
                                     hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return transformers.BertForMaskedLM(config)


def train(rank: int, world: int, device: torch.device, args, split=None, state=None):
    """Trains on this rank; returns every step's loss and the model (and the loop)."""
    torch.manual_seed(args.seed)   # the same initial weights on every rank
    model = build_model(args.size, args.seq, args.dropout).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup))
    loop = BalancedLoop(model, MaskedLMSamples(args.seq, seed=args.seed), global_batch=args.global_batch,
                        split=split, balance=args.balance,
                        wire_dtype=torch.float32 if device.type == "cpu" else torch.float16,
                        seed=args.seed, simulated_speed=simulated_speed(rank, world, device, args),
                        probe_forward=lambda batch: model(**batch).loss)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        loop.load_state_dict(state["loop"])
    losses, log = [], StepLog(args.log_json, rank)
    for step in loop.steps(args.steps):
        for batch in step:
            with loop.autocast():
                loss = model(**batch).loss   # the mean over the micro-batch's masked tokens
            step.backward(loss, count=(batch["labels"] != -100).sum())
        result = step.reduce()               # weighted by masked tokens, which differ per rank
        if not result.skipped:
            result.clip_grad_norm_(1.0)
            optimizer.step()
        scheduler.step()
        losses.append(result.loss)
        log.record(result)
        if rank == 0 and args.log:
            print(f"step {result.number:4d}  loss {result.loss:.4f}  split {'/'.join(map(str, result.split))}",
                  flush=True)
    return losses, model, (optimizer, scheduler, loop)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--seq", type=int, default=64, help="tokens per sample, [CLS] and [SEP] included")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--no-log", dest="log", action="store_false")
    cluster_arguments(p)
    return p


def main(rank: int, world: int, device: torch.device, args) -> None:
    train(rank, world, device, args)


if __name__ == "__main__":
    arguments = parser().parse_args()
    require_transformers()
    launch(main, arguments, nproc=arguments.nproc)
