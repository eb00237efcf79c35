"""hetcomm.loop.BalancedLoop in a user's own loop, on Gloo ranks (CPU): any split trains
exactly as one process on the whole global batch, weighted by the items each loss is
over; a resumed loop continues bit for bit; a throttled rank is rebalanced; bad use
is refused with one clear message on every rank."""

import copy
import math
import time
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks, values
from torch import nn

from hetcomm.balance import WeightedDistributedSampler, handoff
from hetcomm.loop import BalancedLoop
from hetcomm.loop.batches import micro_batches
from hetcomm.simulated import SimulatedSpeed, Slowdown

SAMPLES, LENGTH, VOCAB, GLOBAL_BATCH, SEED = 96, 8, 16, 16, 3


class MaskedTokens(torch.utils.data.Dataset):
    """Sample i: LENGTH tokens, of which i % LENGTH + 1 carry loss, so samples count from
    1 to 8 items and a mean over samples differs from the mean over items."""

    def __init__(self, size: int = SAMPLES):
        generator = torch.Generator().manual_seed(7)
        self.tokens = torch.randint(0, VOCAB, (size, LENGTH), generator=generator)
        self.mask = torch.arange(LENGTH)[None, :] < (torch.arange(size) % LENGTH + 1)[:, None]

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"tokens": self.tokens[i], "targets": (self.tokens[i] * 5 + 3) % VOCAB, "mask": self.mask[i]}


class TinyTagger(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 12)
        self.mix = nn.Linear(12, 12)
        self.out = nn.Linear(12, VOCAB)

    def forward(self, tokens):
        return self.out(torch.tanh(self.mix(self.embed(tokens))))


def masked_loss(model, batch, reduction="mean"):
    """The loss over the batch's masked tokens (mean or sum) and their count."""
    logits = model(batch["tokens"])[batch["mask"]]
    return F.cross_entropy(logits, batch["targets"][batch["mask"]], reduction=reduction), batch["mask"].sum()


def train_in_loop(rank, world, steps, options, stop_after=None, state=None):
    """`steps` SGD steps in a BalancedLoop; returns every step's loss and the weights
    (and, stopping early, everything a checkpoint holds)."""
    model = TinyTagger()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    loop = BalancedLoop(model, MaskedTokens(), global_batch=GLOBAL_BATCH, seed=SEED,
                        **{"wire_dtype": torch.float32, **options})
    if state is not None:
        # Tensors passed to spawned ranks arrive in shared memory, and the optimizer adopts
        # the loaded ones as its own: every rank needs copies, as it would read from a file.
        state = copy.deepcopy(state)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loop.load_state_dict(state["loop"])
    losses, splits = [], []
    for step in loop.steps(steps):
        for batch in step:
            loss, count = masked_loss(model, batch)
            step.backward(loss, count=count)
        result = step.reduce()
        if not result.skipped:
            optimizer.step()
        losses.append(result.loss)
        splits.append([r.samples for r in result.ranks])
        if stop_after is not None and loop.step == stop_after:
            saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "loop": loop.state_dict()}
            return losses, saved
    return losses, [p.detach().clone() for p in model.parameters()], splits


def one_process(steps, by_items=True):
    """The same training on one process: each step's whole global batch in one pass, the
    loss the mean over its masked tokens (or, by_items=False, over its samples)."""
    model, data = TinyTagger(), MaskedTokens()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sampler = WeightedDistributedSampler(len(data), [GLOBAL_BATCH], 0, seed=SEED)
    batches = (indices for _ in range(steps) for indices in sampler)   # epoch after epoch
    losses = []
    for _ in range(steps):
        batch = torch.utils.data.default_collate([data[i] for i in next(batches)])
        optimizer.zero_grad()
        if by_items:
            loss, _ = masked_loss(model, batch)
        else:
            logits = model(batch["tokens"])
            per_token = F.cross_entropy(logits.transpose(1, 2), batch["targets"], reduction="none")
            loss = ((per_token * batch["mask"]).sum(1) / batch["mask"].sum(1)).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def test_an_unequal_split_trains_as_one_process_weighted_by_items(tmp_path):
    ranks = values(run_ranks(4, train_in_loop, 4, {"split": [1, 3, 5, 7]}, tmp_path=tmp_path))
    expected_losses, expected = one_process(4)
    by_samples = one_process(4, by_items=False)[1]
    for losses, weights, splits in ranks:
        assert splits == [[1, 3, 5, 7]] * 4
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=0)
        for got, want, wrong in zip(weights, expected, by_samples):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        # Weighting by samples instead of masked items would land far from where the loop did.
        assert max((w - g).abs().max().item() for w, g in zip(weights, by_samples)) > 1e-3


def train_counting_early_buckets(rank, world, steps, overlap):
    """train_in_loop at the split 1/3/5/7 in small buckets, also counting each step's
    buckets sent before reduce() (during the last backward)."""
    model = TinyTagger()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    loop = BalancedLoop(model, MaskedTokens(), global_batch=GLOBAL_BATCH, seed=SEED, split=[1, 3, 5, 7],
                        wire_dtype=torch.float32, bucket_cap_mb=0.0002, overlap=overlap)
    early = []
    for step in loop.steps(steps):
        for batch in step:
            loss, count = masked_loss(model, batch)
            step.backward(loss, count=count)
        early.append(len(loop.reducer._step.works) if loop.reducer._step is not None else 0)
        step.reduce()
        optimizer.step()
    return early, len(loop.reducer.buckets), [p.detach().clone() for p in model.parameters()]


def test_overlap_sends_buckets_during_the_last_backward_and_trains_the_same(tmp_path):
    expected = one_process(4)[1]
    for overlap in (True, False):
        for early, buckets, weights in values(run_ranks(4, train_counting_early_buckets, 4, overlap,
                                                        tmp_path=tmp_path / str(overlap))):
            for got, want in zip(weights, expected):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            # Every bucket leaves as its last gradient is accumulated, but at the first step,
            # whose total of masked tokens is not known ahead: its buckets wait for it.
            assert buckets >= 3
            assert early == ([0] + [buckets] * 3 if overlap else [0] * 4), early


def test_memory_caps_become_accumulation_with_the_same_gradient(tmp_path):
    capped = values(run_ranks(2, train_in_loop, 3, {"split": [5, 11], "memory_caps": [2, 3]},
                              tmp_path=tmp_path))
    expected = one_process(3)[1]
    for _, weights, _ in capped:
        for got, want in zip(weights, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_resumed_loop_continues_bit_for_bit(tmp_path):
    options = {"split": [6, 10]}
    straight_losses, straight, _ = values(run_ranks(2, train_in_loop, 6, options, tmp_path=tmp_path))[0]
    first_losses, saved = values(run_ranks(2, train_in_loop, 6, options, 3, tmp_path=tmp_path / "a"))[0]
    resumed_losses, resumed, _ = values(run_ranks(2, train_in_loop, 6, options, None, saved,
                                                  tmp_path=tmp_path / "b"))[0]
    assert first_losses + resumed_losses == straight_losses
    assert all(torch.equal(a, b) for a, b in zip(resumed, straight))


def train_throttled(rank, world, throttle_step):
    """Dynamic balancing at equal simulated speeds until rank 1 slows to a tenth."""
    speed = SimulatedSpeed(rank, 0.05, (Slowdown(1, throttle_step, 0.1),))
    return train_in_loop(rank, world, throttle_step + 3, {"simulated_speed": speed})


def test_a_throttled_rank_is_rebalanced_and_the_gradient_stays_exact(tmp_path):
    losses, weights, splits = values(run_ranks(2, train_throttled, 6, tmp_path=tmp_path))[0]
    assert all(sum(done) == GLOBAL_BATCH for done in splits)
    # The handoff within step 6, then the rebalancer: a tenth of the speed earns about
    # 16 / 11 samples. Compared with that, not with the split before the throttle, which
    # wall-clock noise on a loaded machine moves (it was 14/2 once, with 2 tests at a time).
    assert splits[-1][1] <= GLOBAL_BATCH // 8
    expected_losses, expected = one_process(len(losses))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=0)
    for got, want in zip(weights, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def train_throttled_in_micro_batches(rank, world, throttle_step):
    """Shares of 8 in micro-batches of 2 until rank 1 slows to 0.3 of its speed: its first
    micro-batch's forward already says so, and it keeps a part of its share."""
    speed = SimulatedSpeed(rank, 0.05, (Slowdown(1, throttle_step, 0.3),))
    return train_in_loop(rank, world, throttle_step + 2, {"simulated_speed": speed, "memory_caps": [2, 2]})


def test_a_giver_in_micro_batches_keeps_part_of_its_share_and_the_gradient_stays_exact(tmp_path):
    losses, weights, done = values(run_ranks(2, train_throttled_in_micro_batches, 6, tmp_path=tmp_path))[0]
    assert all(sum(d) == GLOBAL_BATCH for d in done)
    # Handed off within step 6, the giver keeping part of its share: compared between the
    # ranks, not with the equal split, which wall-clock noise on a loaded machine can move
    # before the throttle.
    assert 0 < done[6][1] < done[6][0]
    expected_losses, expected = one_process(len(losses))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=0)
    for got, want in zip(weights, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


class CountingSpeed:
    """A simulated speed that stretches nothing and counts each compute phase's settles."""

    def __init__(self):
        self.calls = []

    @contextmanager
    def compute(self, step):
        self.calls.append(0)

        def settle():
            self.calls[-1] += 1

        yield settle
        settle()


def settles_per_phase(rank, world):
    """Two steps at the equal split (one compute phase each), then a forward outside the loop."""
    model, speed = TinyTagger(), CountingSpeed()
    loop = BalancedLoop(model, MaskedTokens(), global_batch=GLOBAL_BATCH, balance="equal",
                        wire_dtype=torch.float32, simulated_speed=speed)
    for step in loop.steps(2):
        for batch in step:
            step.backward(*masked_loss(model, batch))
        step.reduce()
    model(MaskedTokens()[0]["tokens"])
    return speed.calls


def test_a_simulated_speed_is_paid_as_the_compute_goes(tmp_path):
    # Each phase settles after the forward of each of the 3 leaf modules, after each of the 5
    # gradients is accumulated, and at its end; a forward outside a phase settles nothing.
    assert values(run_ranks(2, settles_per_phase, tmp_path=tmp_path)) == [[3 + 5 + 1] * 2] * 2


@pytest.mark.parametrize("size, cap, first, runs", [
    (10, None, None, [10]),
    (10, None, 3, [3, 7]),
    (10, 4, 3, [3, 4, 3]),
    (10, 4, 4, [4, 4, 2]),       # a first run as large as the cap is the cap's
    (10, None, 10, [10]),
    (0, None, 3, []),
])
def test_micro_batches_cut_the_first_run_short_when_asked(size, cap, first, runs):
    indices = list(range(100, 100 + size))
    cut = micro_batches(indices, cap, first)
    assert [len(run) for run in cut] == runs
    assert [i for run in cut for i in run] == indices


def train_recording_micro_batches(rank, world, steps, part):
    """Dynamic balancing at equal simulated speeds; per step, this rank's dealt share and
    the sizes of the micro-batches it was given."""
    model = TinyTagger()
    loop = BalancedLoop(model, MaskedTokens(), global_batch=GLOBAL_BATCH, seed=SEED, wire_dtype=torch.float32,
                        simulated_speed=SimulatedSpeed(rank, 0.05), handoff_report_part=part)
    record = []
    for step in loop.steps(steps):
        sizes = []
        for batch in step:
            sizes.append(len(batch["tokens"]))
            loss, count = masked_loss(model, batch)
            step.backward(loss, count=count)
        record.append((step.reduce().split[rank], sizes))
    return record


@pytest.mark.parametrize("part", [0.25, 1.0])
def test_the_report_comes_after_a_first_micro_batch_of_the_given_part(tmp_path, part):
    for record in values(run_ranks(2, train_recording_micro_batches, 7, part, tmp_path=tmp_path)):
        # Step 0 is timed in parts. Steps 1-3 learn the forward's share of the compute, and
        # until then the report names no giver and the first micro-batch is the whole share;
        # from step 4 on, it holds `part` of the share dealt (rounded up). (Samples taken on
        # from a straggler under load come after it.)
        assert all(sizes[0] == dealt for dealt, sizes in record[1:4])
        assert all(sizes[0] == math.ceil(part * dealt) for dealt, sizes in record[4:]), record


def train_with_two_self_reported_givers(rank, world, steps):
    """train_in_loop with a report cut at a quarter of the share, where from the first
    step whose forward can tell a straggler both ranks report themselves givers: rank 0
    at 100x rank 1's predicted seconds. The plan then makes rank 0 give and rank 1, which
    also reported itself a giver, receive (as under load, when a hiccup slows a rank's
    forward past the planned step in the step where another card throttles). Returns the
    steps' handoffs and the weights."""
    real_report = handoff.report

    def forced_report(first, seconds, own, forward_share, *args):
        if forward_share is None or own == 0:
            return real_report(first, seconds, own, forward_share, *args)
        as_dealt = 100.0 if rank == 0 else 1.0
        return handoff.Report(0, seconds, own, as_dealt / own, 0.0, True, as_dealt)

    handoff.report = forced_report
    model = TinyTagger()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    loop = BalancedLoop(model, MaskedTokens(), global_batch=GLOBAL_BATCH, seed=SEED, wire_dtype=torch.float32,
                        handoff_report_part=0.25)
    plans = []
    for step in loop.steps(steps):
        for batch in step:
            loss, count = masked_loss(model, batch)
            step.backward(loss, count=count)
        result = step.reduce()
        optimizer.step()
        plans.append(result.handoff)
    return plans, [p.detach().clone() for p in model.parameters()]


def test_a_self_reported_giver_that_the_plan_makes_a_receiver_holds_its_buckets(tmp_path):
    # Such a rank learns the plan at its first backward and goes on with the rest of its
    # share: its buckets must not leave with that share's last backward, since samples
    # taken on from the other giver come after it (they left, and the step then failed
    # with "disarm() ... buckets have left", once in a loaded test run).
    ranks = values(run_ranks(2, train_with_two_self_reported_givers, 6, tmp_path=tmp_path))
    expected = one_process(6)[1]
    for plans, weights in ranks:
        handed = [p for p in plans if p is not None]
        assert handed and all(p.received == (0, p.received[1]) and p.received[1] > 0 for p in handed), plans
        for got, want in zip(weights, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def misuse(rank, world, how):
    model = TinyTagger()
    if how == "different weights" and rank == 1:
        with torch.no_grad():
            model.mix.bias.add_(1e-3)
    data = MaskedTokens(8 if how == "short dataset" else SAMPLES - 8 * rank if how == "datasets of two lengths"
                        else SAMPLES)

    def cut_short(samples):
        return torch.utils.data.default_collate(samples[:-1] if len(samples) > 1 else samples * 2)

    batch = GLOBAL_BATCH + 2 * rank if how == "global batches of two sizes" else GLOBAL_BATCH
    loop = BalancedLoop(model, data, global_batch=batch, wire_dtype=torch.float32,
                        split=None if batch != GLOBAL_BATCH else [8, 8],
                        collate_fn=cut_short if how == "collate drops a sample" else None,
                        data_fingerprint=f"v{rank}" if how == "data of two fingerprints" else None)
    for step in loop.steps(1 + rank if how == "steps of two counts" else 1):
        for batch in step:
            if how == "no backward":
                continue
            logits = model(batch["tokens"])
            loss = logits.mean(-1) if how == "loss not a scalar" else logits.mean()
            step.backward(loss, count=-1 if how == "negative count" else None)
        step.reduce()


@pytest.mark.parametrize("how, error, message", [
    ("loss not a scalar", "ValueError", "loss must be a one-element tensor"),
    ("short dataset", "ValueError", "the dataset holds 8 samples, fewer than global_batch = 16"),
    ("collate drops a sample", "ValueError", "collate_fn returned a batch of 7 samples"),
    ("different weights", "ValueError", "parameter 'mix.bias' holds different values on different ranks"),
    ("no backward", "RuntimeError", "step.backward(loss) was not called for a micro-batch"),
    ("negative count", "ValueError", "count = -1: expected a finite, non-negative number"),
    ("datasets of two lengths", "ValueError", "len(dataset) differs between ranks (rank 0: 96, rank 1: 88)"),
    ("global batches of two sizes", "ValueError", "global_batch differs between ranks (rank 0: 16, rank 1: 18)"),
    ("steps of two counts", "ValueError", "BalancedLoop.steps: total differs between ranks (rank 0: 1, rank 1: 2)"),
    ("data of two fingerprints", "ValueError", "data_fingerprint differs between ranks (rank 0: 'v0', rank 1: 'v1')"),
])
def test_bad_use_is_one_clear_error_on_every_rank(tmp_path, how, error, message):
    for result in run_ranks(2, misuse, how, tmp_path=tmp_path, group_timeout_s=20):
        assert result.get("type") == error and message in result["message"], result.get("traceback", result)


def test_a_sixteen_bit_wire_with_its_loss_scale(tmp_path):
    _, weights, _ = values(run_ranks(2, train_in_loop, 3, {"split": [3, 13], "wire_dtype": torch.float16},
                                     tmp_path=tmp_path))[0]
    expected = one_process(3)[1]
    for got, want in zip(weights, expected):
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-4)
    assert all(math.isfinite(w.sum().item()) for w in weights)


BAD_ARGUMENTS = [
    ({"global_batch": 0}, "global_batch = 0: expected an integer of at least the 1 ranks"),
    ({"balance": "fast"}, "balance = 'fast': expected one of dynamic, static, equal"),
    ({"equal_steps": -1}, "equal_steps = -1: expected a non-negative integer"),
    ({"loss_scale": math.nan}, "loss_scale = nan: expected a finite positive number"),
    ({"rebalance_threshold": math.inf}, "rebalance_threshold = inf: expected a finite, non-negative"),
    ({"items_per_sample": 0}, "items_per_sample = 0: expected a positive integer"),
    ({"precision": "fp8"}, "precision = 'fp8': expected auto or one of fp32, fp16, bf16"),
    ({"split": [15]}, "split = [15]: expected 1 non-negative integers adding up to global_batch = 16"),
    ({"memory_caps": [0]}, "memory_caps = [0]: expected one positive integer or None per rank"),
    ({"collate_fn": "stack"}, "collate_fn must be callable"),
    ({"handoff_report_part": 0}, "handoff_report_part = 0: expected a part of a share in (0, 1]"),
    ({"handoff_report_part": 1.5}, "handoff_report_part = 1.5: expected a part of a share in (0, 1]"),
]


def refusals(rank, world):
    messages = []
    for changes, _ in BAD_ARGUMENTS:
        try:
            BalancedLoop(TinyTagger(), MaskedTokens(), **{"global_batch": GLOBAL_BATCH, **changes})
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_bad_arguments_name_the_argument(tmp_path):
    messages = values(run_ranks(1, refusals, tmp_path=tmp_path))[0]
    assert len(messages) == len(BAD_ARGUMENTS)
    for message, (_, expected) in zip(messages, BAD_ARGUMENTS):
        assert expected in message


class FingerprintedTokens(MaskedTokens):
    """A dataset with the fingerprint hook: a string that changes with its content."""

    def __init__(self, version: str):
        super().__init__()
        self.version = version

    def fingerprint(self):
        return self.version


def load_on_other_data(rank, world):
    def loop(data, **options):
        return BalancedLoop(TinyTagger(), data, global_batch=GLOBAL_BATCH, wire_dtype=torch.float32, **options)

    taken = loop(FingerprintedTokens("v1")).state_dict()
    outcomes = [taken["data_fingerprint"]]
    for data, options, data_changed in [(FingerprintedTokens("v2"), {}, False),
                                        (FingerprintedTokens("v2"), {}, True),
                                        (MaskedTokens(), {"data_fingerprint": "v1"}, False),
                                        (MaskedTokens(), {}, False)]:   # no fingerprint: nothing to compare
        try:
            loop(data, **options).load_state_dict(taken, data_changed=data_changed)
            outcomes.append("loaded")
        except ValueError as error:
            outcomes.append(str(error))
    try:
        loop(MaskedTokens(), data_fingerprint=3)
    except TypeError as error:
        outcomes.append(str(error))
    return outcomes


def test_a_state_taken_on_other_data_is_refused_unless_said_changed(tmp_path):
    taken, other, changed, given, unknown, bad = values(run_ranks(1, load_on_other_data, tmp_path=tmp_path))[0]
    assert taken == "v1"
    assert "state was taken on data of fingerprint 'v1'; this loop's dataset has 'v2'" in other
    assert "data_changed=True" in other
    assert changed == given == unknown == "loaded"
    assert bad == "BalancedLoop: data_fingerprint = 3: expected a str or None"


def test_the_loop_needs_a_process_group():
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        BalancedLoop(TinyTagger(), MaskedTokens(), global_batch=GLOBAL_BATCH)


def first_two_splits(rank, world, fast_parts):
    """Two steps at equal speeds, each sample taking 8 ms (slept in the loop body, which the
    loop times as compute), except on rank 1 in the first step's parts listed (1: one sample
    each, 2: the second part, 3: the rest; 0 is the untimed warm-up): 4 ms, as if a
    neighbour's job that shares its card were paused for a while. Returns the splits."""
    model = TinyTagger()
    loop = BalancedLoop(model, MaskedTokens(), global_batch=64, seed=SEED, wire_dtype=torch.float32)
    splits = []
    for step in loop.steps(2):
        for part, batch in enumerate(step):
            fast = rank == 1 and step.number == 0 and part in fast_parts
            time.sleep(len(batch["tokens"]) * (0.004 if fast else 0.008))
            step.backward(*masked_loss(model, batch))
        splits.append(step.reduce().split)
    return splits


def test_the_split_after_the_first_step_rests_on_both_its_timed_parts(tmp_path):
    # Rank 1 twice as fast in the second part (15 samples each), so this step gives it 43 of
    # the 64. At its normal speed in the rest (27 samples, most of the step's time), the
    # steps after give it 35: its throughput over both parts. Twice as fast in the rest
    # too, they keep 43.
    brief, whole = (values(run_ranks(2, first_two_splits, parts, tmp_path=tmp_path / str(len(parts))))[0]
                    for parts in ((2,), (2, 3)))
    assert 41 <= brief[0][1] <= 45 and 41 <= whole[0][1] <= 45
    assert 33 <= brief[1][1] <= 37 and 41 <= whole[1][1] <= 45
