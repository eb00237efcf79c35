"""examples/hf_trainer_bert_mlm.py on 4 Gloo CPU ranks of simulated speeds 1, 1, 0.5 and
0.25 (tiny BERT, dropout 0): the BalancedTrainer gives the slowest rank fewer samples
than the fastest, each rank computes exactly its share of every step, and every step's
logged loss and the final weights are those of a one-process stock Trainer on the same
global batches (the exact mean over the masked tokens, however unequal the shares); the
stock Trainer computes an equal share on every rank. Both runs share one start of the
ranks (the imports of transformers are most of the time)."""

import copy
import sys
from pathlib import Path

import pytest
import torch
from distributed import run_ranks, values
from tolerances import REORDERINGS, farthest, order_bound

import work_clock

pytest.importorskip("transformers", minversion="5.0", reason="the example needs pip install 'hetcomm[hf]'")
pytest.importorskip("accelerate", reason="the example needs pip install 'hetcomm[hf]'")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import hf_trainer_bert_mlm as example  # noqa: E402

CPU = torch.device("cpu")
SPEEDS = "1,1,0.5,0.25"
GLOBAL_BATCH, STEPS = 16, 4


def arguments(trainer: str):
    return example.parser().parse_args(["--trainer", trainer, "--speeds", SPEEDS, "--steps", str(STEPS),
                                        "--global-batch", str(GLOBAL_BATCH), "--seq", "32", "--dropout", "0",
                                        "--warmup", "0", "--no-log"])


class Computed(example.TrainerCallback):
    """The samples the model's training forwards took in each step (Trainer's own, not
    BalancedTrainer's no-grad probe of the loss), each counted on the rank's work clock
    too: BalancedTrainer's split comes from that clock, at the rank's simulated speed,
    not from the wall time of 4 ranks on a busy 2-core host."""

    def __init__(self, clock: work_clock.WorkClock):
        self.samples, self.now, self.clock = [], 0, clock

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        def count(module, positional, named):
            if torch.is_grad_enabled() and module.training:
                self.now += len(named["input_ids"])
                self.clock.count(len(named["input_ids"]))
        model.register_forward_pre_hook(count, with_kwargs=True)

    def on_step_begin(self, args, state, control, **kwargs):
        self.now = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.samples.append(self.now)


def both_trainers(rank, world, runs):
    found = {}
    speed = float(SPEEDS.split(",")[rank])
    for name, args in runs.items():
        computed = Computed(work_clock.install(0.001 / speed))
        summary, trainer = example.train(rank, world, CPU, args, callbacks=[computed])
        found[name] = {"summary": summary, "samples": computed.samples,
                       "weights": [p.detach().clone() for p in trainer.model.parameters()]}
    return found


def one_process(args, out, order=None):
    """The stock Trainer of the example on one process, each step's global batch the next
    GLOBAL_BATCH of the permutation that BalancedTrainer deals (seeded by --seed), its
    samples in order(indices) if given."""
    args = copy.copy(args)
    args.trainer, args.speeds = "stock", "1"
    trainer = example.build_trainer(0, 1, CPU, args, str(out))
    permutation = torch.randperm(len(trainer.train_dataset), generator=torch.Generator().manual_seed(args.seed))
    steps = [permutation[s * GLOBAL_BATCH: (s + 1) * GLOBAL_BATCH].tolist() for s in range(STEPS)]
    drawn = [i for indices in steps for i in (order(indices) if order else indices)]
    trainer._get_train_sampler = lambda dataset=None: drawn
    trainer.train()
    clock = next(c for c in trainer.callback_handler.callbacks if isinstance(c, example.StepClock))
    return clock.losses, [p.detach().clone() for p in trainer.model.parameters()]


def test_balanced_and_stock_trainer_on_a_simulated_cluster(tmp_path):
    runs = {"balanced": arguments("balanced"), "stock": arguments("stock")}
    ranks = values(run_ranks(4, both_trainers, runs, tmp_path=tmp_path))
    balanced, stock = ranks[0]["balanced"], ranks[0]["stock"]

    # Every step, each rank computed exactly the share the trainer reported, and the
    # shares make up the global batch: an equal split first, then one by speed.
    splits = balanced["summary"]["splits"]
    assert [[rank["balanced"]["samples"][s] for rank in ranks] for s in range(STEPS)] == splits
    # Timed on the second step: 16 by speeds 1, 1, 0.5, 0.25 is 5.8, 5.8, 2.9, 1.5, and
    # [6, 6, 3, 1] has the shortest slowest rank (6 samples' time at speed 1).
    assert splits == [[4, 4, 4, 4], [4, 4, 4, 4], [6, 6, 3, 1], [6, 6, 3, 1]], splits
    assert balanced["summary"]["split"] == splits[-1]
    # The stock Trainer: an equal share on every rank, every step.
    assert all(rank["stock"]["samples"] == [GLOBAL_BATCH // 4] * STEPS for rank in ranks)
    assert stock["summary"]["split"] == [4, 4, 4, 4]

    # Unequal shares, the one-process result: every step's loss (the mean over the global
    # batch's masked tokens) and the weights; the same weights on every rank.
    # Within order_bound: what the one-process run moves by when only the order of its
    # sums changes (tests/tolerances.py).
    losses, weights = one_process(runs["balanced"], tmp_path / "one")
    reordered = [one_process(runs["balanced"], tmp_path / f"one-{k}", order) for k, order in enumerate(REORDERINGS)]
    assert len(balanced["summary"]["losses"]) == STEPS
    loss_bound = order_bound([losses], [[other] for other, _ in reordered])
    assert farthest([balanced["summary"]["losses"]], [losses]) <= loss_bound
    weight_bound = order_bound(weights, [other for _, other in reordered])
    assert farthest(balanced["weights"], weights) <= weight_bound
    for rank in ranks[1:]:
        assert all(torch.equal(a, b) for a, b in zip(rank["balanced"]["weights"], balanced["weights"]))
    assert all(torch.isfinite(torch.tensor(stock["summary"]["losses"])))
    assert balanced["summary"]["seconds_per_step"] > 0 and stock["summary"]["seconds_per_step"] > 0
