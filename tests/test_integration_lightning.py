"""BalancedStrategy (hetcomm.integrations.lightning) on 4 Gloo ranks, where Lightning
itself would skip a comm hook: a split of 1/3/5/7 of 16 with each rank's mean loss over
its own tokens trains the weights plain PyTorch trains on the union batches' mean over
all their tokens, with gradient accumulation too; every sample is drawn once an epoch;
a checkpoint resumes bit for bit; a throttled rank gets fewer samples; loaders and
settings it cannot honour are refused by name."""

import os

import pytest
import torch
from distributed import run_ranks, values

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


def union_batches(steps):
    """Plain PyTorch on one process: each step the permutation's next 16 samples (as
    hetcomm deals them), their mean loss over all their tokens."""
    net, data = network(), samples()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(0)).tolist()
    for step in range(steps):
        batch = torch.utils.data.default_collate([data[i] for i in order[16 * step: 16 * step + 16]])
        optimizer.zero_grad()
        mean_loss(net, batch).backward()
        optimizer.step()
    return [p.detach().clone() for p in net.parameters()]


def farthest(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def test_uneven_split_equals_the_union_batch_mean_over_tokens(tmp_path):
    ranks = values(run_ranks(4, split_runs, tmp_path=tmp_path))
    reference = union_batches(4)
    for run in range(2):
        assert farthest(ranks[0][run][0], ranks[3][run][0]) == 0
        assert farthest(ranks[0][run][0], reference) < 1e-6, farthest(ranks[0][run][0], reference)
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
    assert farthest([p.detach() for p in net.parameters()], union_batches(4)) > 1e-3


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


def test_resume_goes_on_with_the_same_samples_and_split(tmp_path):
    """The resumed steps draw exactly the samples the straight run drew, on the split
    timed before the checkpoint. The weights agree to a few ulps, not bit for bit: DDP
    lays its buckets out anew after a restart's first step, and Gloo's ring then sums
    some elements over the ranks in another order (the Trainer's DDP, which looks for
    unused parameters, keeps its layout and resumes bit for bit)."""
    ranks = values(run_ranks(4, resume_and_throttle, str(tmp_path), tmp_path=tmp_path))
    for rank, (_, _, split, _, served, served_after) in enumerate(ranks):
        assert served == served_after and len(served) == 3 * split[rank]
    straight, resumed, split, split_after, _, _ = ranks[0]
    assert farthest(straight, resumed) < 1e-6
    # 16 by throughputs 4:4:4:1 (rank 3 at 4 ms a sample, the others at 1 ms)
    assert split == split_after == (5, 5, 5, 1), split


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
