"""BalancedStrategy (hetcomm.integrations.lightning) on 4 Gloo ranks, where Lightning
itself would skip a comm hook: a split of 1/3/5/7 of 16 with each rank's mean loss over
its own tokens trains the weights plain PyTorch trains on the union batches' mean over
all their tokens, with gradient accumulation too; every sample is drawn once an epoch;
a checkpoint resumes bit for bit, and its checkpoint["hetcomm"] changed, of the old
format, of another step or of another run is refused naming the file; a throttled rank
gets fewer samples; loaders and settings it cannot honour, and arguments of a wrong type
or value, are refused by name."""

import os
from pathlib import Path

import pytest
import torch
from balancing_state_formats import as_format_1
from distributed import run_ranks, values
from tolerances import REORDERINGS, farthest, order_bound

import work_clock
from torch import nn

pytest.importorskip("lightning", minversion="2.4", reason="BalancedStrategy needs pip install 'hetcomm[lightning]'")

SAMPLES, SEQ, VOCAB = 64, 6, 16
SPLIT = [1, 3, 5, 7]


def samples():
    """Token windows whose labels mask a different number of positions each, so that
    weighting by samples and by tokens differ."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(SAMPLES):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        labels = torch.randint(0, VOCAB, (SEQ,), generator=g)
        labels[: int(torch.randint(0, SEQ - 1, (), generator=g))] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


class Served(torch.utils.data.Dataset):
    def __init__(self):
        self.items, self.served = samples(), []

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        self.served.append(int(i))
        return self.items[i]


def network():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Tanh(), nn.Linear(8, VOCAB))


def mean_loss(net, batch):
    logits = net(batch["input_ids"])
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def module(clock=None):
    import lightning as L

    class Tokens(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = network()

        def training_step(self, batch, batch_idx):
            if clock is not None:
                clock.count(len(batch["input_ids"]))
            return mean_loss(self.net, batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    return Tokens()


def trainer(world, steps, accumulation=1, **strategy):
    import lightning as L

    from hetcomm.integrations.lightning import BalancedStrategy
    return L.Trainer(accelerator="cpu", devices=world, strategy=BalancedStrategy(wire_dtype=torch.float32, **strategy),
                     use_distributed_sampler=False, max_steps=steps, accumulate_grad_batches=accumulation, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def as_launched(rank, world):
    """The environment a launcher gives each rank (the process group exists already)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), NODE_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))


def loader(data, per_rank):
    return torch.utils.data.DataLoader(data, batch_size=per_rank, shuffle=True)


def weights(lightning_module):
    return [p.detach().clone() for p in lightning_module.parameters()]


def split_runs(rank, world):
    as_launched(rank, world)
    found = []
    for accumulation, split in ((1, SPLIT), (2, [2, 2, 5, 7])):
        data, model = Served(), module()
        trainer(world, 4, accumulation, split=split).fit(model, loader(data, 4 // accumulation))
        found.append((weights(model), data.served))
    return found


def union_batches(steps, reorder=None):
    """Plain PyTorch on one process: each step the permutation's next 16 samples (as
    hetcomm deals them; in reorder(indices), if given), their mean loss over all their
    tokens."""
    net, data = network(), samples()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(0)).tolist()
    for step in range(steps):
        indices = order[16 * step: 16 * step + 16]
        batch = torch.utils.data.default_collate([data[i] for i in (reorder(indices) if reorder else indices)])
        optimizer.zero_grad()
        mean_loss(net, batch).backward()
        optimizer.step()
    return [p.detach().clone() for p in net.parameters()]


def union_bound(steps):
    """How far a run of union_batches(steps) may land from it: order_bound of the same
    run on its batches in REORDERINGS (tests/tolerances.py)."""
    return order_bound(union_batches(steps), [union_batches(steps, reorder) for reorder in REORDERINGS])


def test_uneven_split_equals_the_union_batch_mean_over_tokens(tmp_path):
    ranks = values(run_ranks(4, split_runs, tmp_path=tmp_path))
    reference, bound = union_batches(4), union_bound(4)
    for run in range(2):
        assert farthest(ranks[0][run][0], ranks[3][run][0]) == 0
        assert farthest(ranks[0][run][0], reference) <= bound, (farthest(ranks[0][run][0], reference), bound)
    served = [rank[0][1] for rank in ranks]
    assert [len(s) for s in served] == [4 * b for b in SPLIT]
    assert sorted(i for s in served for i in s) == list(range(SAMPLES))


def test_equal_weighting_of_the_ranks_means_is_not_the_reference():
    """The check above can fail: each rank's mean weighted by its share of the samples."""
    net, data = network(), samples()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(0)).tolist()
    for step in range(4):
        batch = torch.utils.data.default_collate([data[i] for i in order[16 * step: 16 * step + 16]])
        starts = [0, 1, 4, 9]
        optimizer.zero_grad()
        loss = sum(b / 16 * mean_loss(net, {k: v[s: s + b] for k, v in batch.items()}) for s, b in zip(starts, SPLIT))
        loss.backward()
        optimizer.step()
    assert farthest([p.detach() for p in net.parameters()], union_batches(4)) > 50 * union_bound(4)


def resume_and_throttle(rank, world, out):
    """6 steps straight with a checkpoint at 3 (past the first epoch's 4) on a split
    timed on the first step (rank 3 throttled), then again from that checkpoint."""
    import lightning as L
    as_launched(rank, world)
    clock = work_clock.install(0.004 if rank == 3 else 0.001)
    model, data = module(clock), Served()
    saving = L.pytorch.callbacks.ModelCheckpoint(dirpath=out, every_n_train_steps=3, save_top_k=-1)
    straight = trainer(world, 6, balance="static")
    straight.callbacks.append(saving)
    straight.fit(model, loader(data, 4))
    resumed_model, resumed_data = module(clock), Served()
    resumed = trainer(world, 6, balance="static")
    resumed.fit(resumed_model, loader(resumed_data, 4), ckpt_path=f"{out}/epoch=0-step=3.ckpt")
    return (weights(model), weights(resumed_model), straight.strategy.batches.split, resumed.strategy.batches.split,
            data.served[len(data.served) - len(resumed_data.served):], resumed_data.served)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """resume_and_throttle's results on 4 ranks, and the folder of its checkpoints."""
    out = tmp_path_factory.mktemp("resume")
    return values(run_ranks(4, resume_and_throttle, str(out), tmp_path=out)), out


def test_resume_goes_on_with_the_same_samples_and_split(resumed):
    """The resumed steps draw exactly the samples the straight run drew, on the split
    timed before the checkpoint. The weights agree to a few ulps, not bit for bit: DDP
    lays its buckets out anew after a restart's first step, and Gloo's ring then sums
    some elements over the ranks in another order (the Trainer's DDP, which looks for
    unused parameters, keeps its layout and resumes bit for bit)."""
    ranks, _ = resumed
    for rank, (_, _, split, _, served, served_after) in enumerate(ranks):
        assert served == served_after and len(served) == 3 * split[rank]
    straight, resumed, split, split_after, _, _ = ranks[0]
    # The restart reorders some of the all-reduce's sums of 3 steps; the union batches
    # reordered over 4 steps bound that (tests/tolerances.py).
    assert farthest(straight, resumed) <= union_bound(4)
    # 16 by throughputs 4:4:4:1 (rank 3 at 4 ms a sample, the others at 1 ms)
    assert split == split_after == (5, 5, 5, 1), split


def spoilt_checkpoints(saved, foreign, into) -> dict:
    """Copies of a one-process run's step-3 checkpoint, each with its checkpoint["hetcomm"]
    spoilt one way, and the 4-rank run's as it is (for one process, another run's)."""
    from hetcomm.integrations.lightning import CHECKPOINT_KEY
    step3 = torch.load(saved / "epoch=0-step=3.ckpt", weights_only=False)
    step6 = torch.load(next(saved.glob("*step=6.ckpt")), weights_only=False)
    edited = {**step3[CHECKPOINT_KEY], "batches": {**step3[CHECKPOINT_KEY]["batches"]}}
    edited["batches"]["sampler"] = {**edited["batches"]["sampler"], "epoch": 1}   # another epoch's permutation
    variants = {"edited": {**step3, CHECKPOINT_KEY: edited},
                "format 1": {**step3, CHECKPOINT_KEY: as_format_1(step3[CHECKPOINT_KEY]["batches"])},
                "of another step": {**step3, CHECKPOINT_KEY: step6[CHECKPOINT_KEY]},
                "foreign": torch.load(foreign / "epoch=0-step=3.ckpt", weights_only=False)}
    paths = {}
    for name, checkpoint in variants.items():
        paths[name] = into / f"{name.replace(' ', '-')}.ckpt"
        torch.save(checkpoint, paths[name])
    return paths


def resumes_refused(rank, world, out, foreign):
    """One process with the 4-rank run's global batch saves at steps 3 and 6; each spoilt
    checkpoint resumed by the same: the paths, each one's error and the samples trained
    on before it."""
    import lightning as L
    as_launched(rank, world)
    saving = L.pytorch.callbacks.ModelCheckpoint(dirpath=f"{out}/saved", every_n_train_steps=3, save_top_k=-1)
    straight = trainer(world, 6, balance="static")
    straight.callbacks.append(saving)
    straight.fit(module(), loader(Served(), 16))
    paths = spoilt_checkpoints(Path(out) / "saved", Path(foreign), Path(out))
    found = {}
    for name, path in paths.items():
        trained = Trained()
        try:
            trainer(world, 6, balance="static").fit(module(trained), loader(Served(), 16), ckpt_path=str(path))
            found[name] = (None, "resumed", trained.samples)
        except Exception as error:  # the test inspects which error, and its message
            found[name] = (type(error), str(error), trained.samples)
    return paths, found


class Trained:
    """Counts the samples of training steps (module's clock)."""
    samples = 0

    def count(self, samples):
        self.samples += samples


def test_a_spoilt_or_foreign_hetcomm_entry_is_refused_in_one_line_naming_the_file(resumed, tmp_path):
    paths, found = values(run_ranks(1, resumes_refused, str(tmp_path), str(resumed[1]), tmp_path=tmp_path))[0]
    why = {"edited": "does not hold what was written (damaged or edited)", "format 1": "format 1",
           "of another step": "balancing state after step 6, the checkpoint's training state after step 3",
           "foreign": "world 4 there, 1 here"}
    assert set(found) == set(why)
    for name, (kind, message, trained) in found.items():
        assert kind is not None and issubclass(kind, ValueError), (name, kind, message)
        assert f"{paths[name]} (its 'hetcomm' entry)" in message and why[name] in message, (name, message)
        assert "resume from another checkpoint, or start fresh" in message and "\n" not in message, message
        assert trained == 0, (name, trained)


@pytest.mark.parametrize("arguments, error, named", [
    ({"wire_dtype": torch.int8}, ValueError, "wire_dtype = torch.int8: expected torch.float16"),
    ({"wire_dtype": "float16"}, TypeError, "wire_dtype = 'float16': expected a torch.dtype"),
    ({"wire_dtype": torch.bfloat16, "process_group_backend": "gloo"}, ValueError,
     "the Gloo backend cannot all-reduce bfloat16"),
    ({"balance": "fast"}, ValueError, "balance = 'fast': expected one of"),
    ({"balance": None}, TypeError, "balance = None: expected a str"),
    ({"split": [4, 0]}, ValueError, "split = [4, 0]: expected positive integers"),
    ({"split": 16}, TypeError, "split = 16: expected a sequence of integers"),
    ({"max_micro_batch": 0}, ValueError, "max_micro_batch = 0: expected a positive integer"),
    ({"max_micro_batch": [2, 2.5]}, TypeError, "max_micro_batch = [2, 2.5]: expected a sequence of integers"),
    ({"count_items": "labels"}, TypeError, "count_items = 'labels': expected None or a function"),
    ({"seed": 1.5}, TypeError, "seed = 1.5: expected an integer"),
])
def test_each_argument_is_checked_at_construction_by_name(arguments, error, named):
    from hetcomm.integrations.lightning import BalancedStrategy
    with pytest.raises(error) as raised:
        BalancedStrategy(**arguments)
    assert str(raised.value).startswith("BalancedStrategy: ") and named in str(raised.value), str(raised.value)


def refusals(rank, world):
    as_launched(rank, world)
    from hetcomm.integrations.lightning import BalancedStrategy
    data = Served()
    manual = module()
    manual.automatic_optimization = False
    cases = {"use_distributed_sampler": (dict(use_distributed_sampler=True), loader(data, 4), module()),
             "SequentialSampler": ({}, torch.utils.data.DataLoader(data, batch_size=4), module()),
             "IterableDataset": ({}, torch.utils.data.DataLoader(Stream(), batch_size=4), module()),
             "automatic_optimization": ({}, loader(data, 4), manual)}
    messages = {}
    for name, (extra, train, lightning_module) in cases.items():
        try:
            import lightning as L
            settings = dict(accelerator="cpu", devices=world, strategy=BalancedStrategy(), max_steps=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            use_distributed_sampler=False)
            L.Trainer(**{**settings, **extra}).fit(lightning_module, train)
        except ValueError as error:
            messages[name] = str(error)
    try:
        BalancedStrategy(ddp_comm_hook=lambda *a: None)
    except ValueError as error:
        messages["ddp_comm_hook"] = str(error)
    return messages


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(samples())


def test_loaders_and_settings_it_cannot_honour_are_refused_by_name(tmp_path):
    messages = values(run_ranks(2, refusals, tmp_path=tmp_path))[0]
    assert set(messages) == {"use_distributed_sampler", "SequentialSampler", "IterableDataset", "ddp_comm_hook",
                             "automatic_optimization"}
    for name, message in messages.items():
        assert name in message, message
