"""What the examples share and a user brings of their own: a text data set (Python's
standard-library sources, which ship with Python, read as bytes: nothing is
downloaded), BERT's masking of it, and the command line of a (simulated) cluster."""

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from hetcomm.train.data import default_corpus
from hetcomm.simulated import SimulatedSpeed, parse_slowdown, parse_speeds, speeds_for_this_machine

# Token ids: four special tokens, then the 256 byte values.
PAD, CLS, SEP, MASK = 0, 1, 2, 3
SPECIAL = 4
BYTE_VOCAB = SPECIAL + 256


def require_transformers():
    """transformers, or a one-line message naming what to install."""
    try:
        import transformers
    except ImportError:
        raise SystemExit("this example needs Hugging Face transformers: pip install 'hetcomm[hf]' "
                         "(or pip install transformers)") from None
    return transformers


class ByteWindows(torch.utils.data.Dataset):
    """Sample i: `length` consecutive bytes of the corpus from i * length, as token ids."""

    def __init__(self, length: int, corpus: np.ndarray | None = None):
        self.corpus = default_corpus()[0] if corpus is None else corpus
        self.length = length
        if len(self) < 1:
            raise ValueError(f"the corpus holds {self.corpus.size} bytes: too few for one sample of {length}")

    def __len__(self) -> int:
        return self.corpus.size // self.length

    def tokens(self, i: int) -> torch.Tensor:
        start = i * self.length
        return torch.from_numpy(self.corpus[start:start + self.length].astype(np.int64)) + SPECIAL


class CausalLMSamples(ByteWindows):
    """Next-token prediction: the labels are the inputs (the model shifts them)."""

    def __getitem__(self, i: int) -> dict:
        ids = self.tokens(i)
        return {"input_ids": ids, "labels": ids.clone()}


class MaskedLMSamples(ByteWindows):
    """BERT's masked language modelling on [CLS] bytes [SEP]: 15% of the bytes are
    chosen, 80% of those replaced by [MASK], 10% by a random byte, 10% kept; the labels
    are the chosen bytes (-100 elsewhere). The choice is drawn from the sample's index
    and the seed (static masking, as BERT's own data preparation did), so every rank
    and a one-process reference see the same masks."""

    def __init__(self, length: int, corpus: np.ndarray | None = None, seed: int = 0, probability: float = 0.15):
        super().__init__(length - 2, corpus)
        self.seed, self.probability = seed, probability

    def __getitem__(self, i: int) -> dict:
        ids = self.tokens(i)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        chosen = torch.rand(ids.shape, generator=generator) < self.probability
        action = torch.rand(ids.shape, generator=generator)
        random_bytes = torch.randint(SPECIAL, BYTE_VOCAB, ids.shape, generator=generator)
        labels = torch.where(chosen, ids, -100)
        inputs = torch.where(chosen & (action < 0.8), MASK, ids)
        inputs = torch.where(chosen & (action >= 0.8) & (action < 0.9), random_bytes, inputs)
        edge = torch.tensor([CLS]), torch.tensor([SEP]), torch.tensor([-100])
        return {"input_ids": torch.cat([edge[0], inputs, edge[1]]),
                "attention_mask": torch.ones(ids.numel() + 2, dtype=torch.int64),
                "labels": torch.cat([edge[2], labels, edge[2]])}


def cluster_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cluster")
    group.add_argument("--nproc", type=int, help="local processes (default: the GPUs, or 4 simulated CPU workers)")
    group.add_argument("--speeds", help="CPU only: simulated speed factor per rank (default: 1,1,0.5,0.25 fitted "
                                        "to this machine's cores)")
    group.add_argument("--slowdown", action="append", default=[], metavar="RANK:STEP:FACTOR",
                       help="CPU only: rank RANK runs FACTOR times as fast from STEP on (a card throttling)")
    group.add_argument("--balance", choices=("dynamic", "static", "equal"), default="dynamic",
                       help="dynamic: time the first step, rebalance, hand a straggler's samples off; static: the "
                            "first step's split throughout; equal: no balancing (plain DDP)")
    group.add_argument("--log-json", metavar="PATH", help="rank 0 writes a JSON line per step here (the benchmarks "
                                                          "read it)")
    group.add_argument("--global-batch", type=int, default=32, help="samples per optimizer step over all ranks")
    group.add_argument("--steps", type=int, default=30)
    group.add_argument("--seed", type=int, default=0)


def simulated_speed(rank: int, world: int, device: torch.device, args) -> SimulatedSpeed | None:
    """On CPU workers, this rank's simulated speed (a cluster of unequal cards on one
    machine); none on GPUs, whose speeds are their own."""
    if device.type != "cpu":
        return None
    relative = [1.0, 1.0, 0.5, 0.25][:world] + [1.0] * (world - 4)
    factors = parse_speeds(args.speeds or speeds_for_this_machine(relative), world)
    return SimulatedSpeed(rank, factors[rank], tuple(parse_slowdown(s, world) for s in args.slowdown))


class StepLog:
    """Rank 0's JSON line per step: the split, the samples each rank did and at what
    rate, its compute seconds and its previous step's reduce and update seconds, the
    step's wall time up to the next step, the loss."""

    def __init__(self, path: str | None, rank: int):
        self.file = open(Path(path), "w") if path and rank == 0 else None
        self.last = time.perf_counter()

    def record(self, result) -> None:
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        if self.file is None:
            return
        samples = [r.samples for r in result.ranks]
        rates = [r.samples / r.compute_s if r.compute_s > 0 and r.samples else 0.0 for r in result.ranks]
        self.file.write(json.dumps({"step": result.number, "phase": result.regime, "loss": result.loss,
                                    "micro_batch": list(result.split), "samples": samples,
                                    "samples_per_second": rates, "step_s": seconds,
                                    "compute_s": [r.compute_s for r in result.ranks],
                                    "previous_reduce_s": [r.previous_reduce_s for r in result.ranks],
                                    "previous_update_s": [r.previous_update_s for r in result.ranks],
                                    "handoff": None if result.handoff is None else result.handoff.moved}) + "\n")
        self.file.flush()
