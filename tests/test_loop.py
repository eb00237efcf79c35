"""hetcomm.loop.BalancedLoop in a user's own loop, on Gloo ranks (CPU): any split trains
exactly as one process on the whole global batch, weighted by the items each loss is
over; a resumed loop continues bit for bit; a throttled rank is rebalanced, to the split
the solver gives for the costs the work clock charges (tests/work_clock.py); bad use is
refused with one clear message on every rank."""

import copy
import math
from contextlib import contextmanager
from functools import partial

import pytest
import torch
import torch.nn.functional as F
import work_clock
from distributed import run_ranks, values
from tolerances import REORDERINGS, UNIT_ROUNDOFF, farthest, order_bound
from torch import nn

from hetcomm.balance import WeightedDistributedSampler, handoff, solve_split
from hetcomm.loop import BalancedLoop
from hetcomm.loop.batches import micro_batches

SAMPLES, LENGTH, VOCAB, GLOBAL_BATCH, SEED = 96, 8, 16, 16, 3
# On the work clock (tests/work_clock.py) a sample costs COST seconds, FORWARD_PART of it
# at its forward and the rest at its backward, so that the splits a test asserts follow
# from the solver's math instead of a busy host's wall clock.
COST, FORWARD_PART = 2.0 ** -6, 0.25
THROTTLE_STEP = 6


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


def train_in_loop(rank, world, steps, options, stop_after=None, state=None, cost=None):
    """`steps` SGD steps in a BalancedLoop; returns every step's loss and the weights
    (and, stopping early, everything a checkpoint holds). With `cost`, the steps are timed
    by the work clock, a sample of micro-batch `part` of a step costing cost(rank, step,
    part) seconds."""
    model = TinyTagger()
    clock = None
    if cost is not None:
        clock = work_clock.install(COST)
        clock.count_passes(model, FORWARD_PART)
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
        for part, batch in enumerate(step):
            if clock is not None:
                clock.seconds_per_sample = cost(rank, step.number, part)
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


def one_process(steps, by_items=True, order=None):
    """The same training on one process: each step's whole global batch in one pass (its
    samples in order(indices), if given), the loss the mean over its masked tokens (or,
    by_items=False, over its samples)."""
    model, data = TinyTagger(), MaskedTokens()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sampler = WeightedDistributedSampler(len(data), [GLOBAL_BATCH], 0, seed=SEED)
    batches = (indices for _ in range(steps) for indices in sampler)   # epoch after epoch
    losses = []
    for _ in range(steps):
        indices = list(next(batches))
        batch = torch.utils.data.default_collate([data[i] for i in (order(indices) if order else indices)])
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


def reference(steps):
    """one_process(steps)'s losses and weights, and how far an exact run may land from
    each: order_bound of the same run on its batches in REORDERINGS (tests/tolerances.py)."""
    losses, weights = one_process(steps)
    reordered = [one_process(steps, order=order) for order in REORDERINGS]
    return (losses, weights, order_bound([losses], [[other] for other, _ in reordered]),
            order_bound(weights, [other for _, other in reordered]))


def assert_equals_reference(steps, weights, losses=None):
    expected_losses, expected, loss_bound, weight_bound = reference(steps)
    if losses is not None:
        assert farthest([losses], [expected_losses]) <= loss_bound, (losses, expected_losses, loss_bound)
    assert farthest(weights, expected) <= weight_bound, (farthest(weights, expected), weight_bound)
    return weight_bound


def test_an_unequal_split_trains_as_one_process_weighted_by_items(tmp_path):
    ranks = values(run_ranks(4, train_in_loop, 4, {"split": [1, 3, 5, 7]}, tmp_path=tmp_path))
    by_samples = one_process(4, by_items=False)[1]
    for losses, weights, splits in ranks:
        assert splits == [[1, 3, 5, 7]] * 4
        bound = assert_equals_reference(4, weights, losses)
        # Weighting by samples instead of masked items would land far from where the loop did.
        assert farthest(weights, by_samples) > 50 * bound


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
    for overlap in (True, False):
        for early, buckets, weights in values(run_ranks(4, train_counting_early_buckets, 4, overlap,
                                                        tmp_path=tmp_path / str(overlap))):
            assert_equals_reference(4, weights)
            # Every bucket leaves as its last gradient is accumulated, but at the first step,
            # whose total of masked tokens is not known ahead: its buckets wait for it.
            assert buckets >= 3
            assert early == ([0] + [buckets] * 3 if overlap else [0] * 4), early


def test_memory_caps_become_accumulation_with_the_same_gradient(tmp_path):
    capped = values(run_ranks(2, train_in_loop, 3, {"split": [5, 11], "memory_caps": [2, 3]},
                              tmp_path=tmp_path))
    for _, weights, _ in capped:
        assert_equals_reference(3, weights)


def test_a_resumed_loop_continues_bit_for_bit(tmp_path):
    options = {"split": [6, 10]}
    straight_losses, straight, _ = values(run_ranks(2, train_in_loop, 6, options, tmp_path=tmp_path))[0]
    first_losses, saved = values(run_ranks(2, train_in_loop, 6, options, 3, tmp_path=tmp_path / "a"))[0]
    resumed_losses, resumed, _ = values(run_ranks(2, train_in_loop, 6, options, None, saved,
                                                  tmp_path=tmp_path / "b"))[0]
    assert first_losses + resumed_losses == straight_losses
    assert all(torch.equal(a, b) for a, b in zip(resumed, straight))


def throttled(factor, rank, step, part):
    """COST a sample, rank 1's divided by `factor` (its speed) from THROTTLE_STEP on."""
    return COST / factor if rank == 1 and step >= THROTTLE_STEP else COST


def test_a_throttled_rank_is_rebalanced_and_the_gradient_stays_exact(tmp_path):
    # Equal ranks until rank 1 slows to a tenth at step 6. Step 6 hands its share off: its
    # forward of all 8 samples takes 8 x 0.25 x 10 COST = 20 COST, which at the forward's
    # learned quarter of the compute predicts 80 COST, past 1.5x the planned 8; each of its
    # 8 samples then ends sooner on rank 0 (8 + k COST) than on rank 1 after that forward
    # (20 + 10 COST), so rank 0 does all 16 and rank 1 drops its forward. The rebalancer
    # takes the throttle from the giver's prediction on trial and the split follows at
    # once to the best for the new speeds, which step 7 confirms.
    losses, weights, splits = values(run_ranks(2, train_in_loop, THROTTLE_STEP + 3, {}, None, None,
                                               partial(throttled, 0.1), tmp_path=tmp_path))[0]
    best = solve_split(GLOBAL_BATCH, [(0.0, COST), (0.0, COST / 0.1)]).sizes
    assert best == (15, 1)
    assert splits == [[8, 8]] * THROTTLE_STEP + [[16, 0]] + [list(best)] * 2
    assert_equals_reference(len(losses), weights, losses)


def test_a_giver_in_micro_batches_keeps_part_of_its_share_and_the_gradient_stays_exact(tmp_path):
    # Shares of 8 in micro-batches of 2 until rank 1 slows to 0.3 of its speed at step 6
    # (a sample: r = COST / 0.3). Its first micro-batch's forward, 2 x 0.25 r, predicts its
    # share at 8 r = 26.7 COST, a giver. Its 8 samples go one by one to the rank that ends
    # each first: rank 1 after that forward (0.5 r) plus r a sample, rank 0 after its own
    # 8 COST plus COST a sample: rank 1 takes the 1st, 2nd and 6th (5, 8.3, 11.7 COST),
    # rank 0 the other 5 (9 to 13 COST). Rank 1 keeps 3, more than the micro-batch it
    # timed, and goes on from it; the rebalancer then moves to the best split, 13/3.
    losses, weights, done = values(run_ranks(2, train_in_loop, THROTTLE_STEP + 2, {"memory_caps": [2, 2]}, None,
                                             None, partial(throttled, 0.3), tmp_path=tmp_path))[0]
    best = solve_split(GLOBAL_BATCH, [(0.0, COST), (0.0, COST / 0.3)]).sizes
    assert best == (13, 3)
    assert done == [[8, 8]] * THROTTLE_STEP + [[13, 3], list(best)]
    assert_equals_reference(len(losses), weights, losses)


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
    """Dynamic balancing at equal speeds on the work clock; per step, this rank's dealt
    share and the sizes of the micro-batches it was given."""
    model = TinyTagger()
    work_clock.install(COST).count_passes(model, FORWARD_PART)
    loop = BalancedLoop(model, MaskedTokens(), global_batch=GLOBAL_BATCH, seed=SEED, wire_dtype=torch.float32,
                        handoff_report_part=part)
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
    first = math.ceil(part * (GLOBAL_BATCH // 2))
    for record in values(run_ranks(2, train_recording_micro_batches, 7, part, tmp_path=tmp_path)):
        # Step 0 is timed in parts: a warm-up sample, one sample each, 3 of the half of the
        # batch left after those, then the rest of the equal split they time. Steps 1-3
        # learn the forward's share of the compute, and until then the report names no
        # giver and the first micro-batch is the whole share; from step 4 on, it holds
        # `part` of the share dealt (rounded up), the rest of the share following it.
        assert record[0] == (8, [1, 1, 3, 4])
        assert record[1:4] == [(8, [8])] * 3
        assert record[4:] == [(8, [first] + [8 - first] * (first < 8))] * 3, record


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
    for plans, weights in ranks:
        handed = [p for p in plans if p is not None]
        assert handed and all(p.received == (0, p.received[1]) and p.received[1] > 0 for p in handed), plans
        assert_equals_reference(6, weights)


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
    # The wire's roundings, plus what fp32's own reordering moves the run by.
    _, expected, _, reordering = reference(3)
    for got, want, most in zip(weights, expected, fp16_wire_bound(3, [3, 13])):
        assert ((got - want).abs() <= most + reordering).all(), ((got - want).abs() - most).max()
    assert all(math.isfinite(w.sum().item()) for w in weights)


def fp16_wire_bound(steps, split, loss_scale=2.0**12, lr=0.5, momentum=0.9):
    """Elementwise, to first order, how far SGD with momentum on an fp16 wire may land from
    one_process(steps): each rank's weighted, loss-scaled part of a gradient element is
    rounded to fp16 once when packed, and the two ranks' sum once more on the wire: at
    most u16 (|a| + |b|) + u16 |a + b| <= 2 u16 (|a| + |b|) of an element whose parts are
    a and b, plus half fp16's subnormal spacing per rounding, unscaled. The momentum
    buffer carries a step's error into the later updates: |error| <= lr sum_k A_k, with
    A_k = momentum A_(k-1) + e_k. The parts are each rank's share of the global batch,
    weighted by its masked tokens, from the same one-process run."""
    u16, spacing = UNIT_ROUNDOFF[torch.float16], 2.0 ** -24
    model, data = TinyTagger(), MaskedTokens()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    sampler = WeightedDistributedSampler(len(data), [GLOBAL_BATCH], 0, seed=SEED)
    batches = (indices for _ in range(steps) for indices in sampler)
    carried = [torch.zeros_like(p) for p in model.parameters()]
    bound = [torch.zeros_like(p) for p in model.parameters()]
    for _ in range(steps):
        batch = torch.utils.data.default_collate([data[i] for i in next(batches)])
        starts = [sum(split[:r]) for r in range(len(split))]
        parts = [{k: v[s:s + b] for k, v in batch.items()} for s, b in zip(starts, split)]
        total = sum(part["mask"].sum() for part in parts)
        magnitude = [torch.zeros_like(p) for p in model.parameters()]
        optimizer.zero_grad()
        for part in parts:
            loss, count = masked_loss(model, part)
            grads = torch.autograd.grad(loss * count / total, list(model.parameters()))
            for m, g, p in zip(magnitude, grads, model.parameters()):
                m += g.abs()
                p.grad = g if p.grad is None else p.grad + g
        for c, b, m in zip(carried, bound, magnitude):
            c.mul_(momentum).add_(2 * u16 * m + len(split) * spacing / loss_scale)
            b.add_(lr * c)
        optimizer.step()
    return bound


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


def twice_as_fast_in_parts(fast_parts, rank, step, part):
    """COST a sample, but half of it on rank 1 in the listed parts of step 0 (1: one sample
    each, 2: the second part, 3: the rest; 0 is the untimed warm-up), as if a neighbour's
    job that shares its card were paused for a while."""
    return COST / 2 if rank == 1 and step == 0 and part in fast_parts else COST


def first_two_splits(rank, world, fast_parts):
    """Two steps of a global batch of 64 on the work clock, a sample costing
    twice_as_fast_in_parts(fast_parts, ...); returns the splits dealt."""
    model = TinyTagger()
    clock = work_clock.install(COST)
    clock.count_passes(model, FORWARD_PART)
    loop = BalancedLoop(model, MaskedTokens(), global_batch=64, seed=SEED, wire_dtype=torch.float32)
    splits = []
    for step in loop.steps(2):
        for part, batch in enumerate(step):
            clock.seconds_per_sample = twice_as_fast_in_parts(fast_parts, rank, step.number, part)
            step.backward(*masked_loss(model, batch))
        splits.append(list(step.reduce().split))
    return splits


def test_the_split_after_the_first_step_rests_on_both_its_timed_parts(tmp_path):
    # A global batch of 64: one sample each, then 15 each (half the batch less those), then
    # the rest of this step's split. Rank 1 twice as fast in the second part gets the share
    # its speed there earns (at least the 16 each has done). At its normal speed in the
    # rest, the steps after give it the share of its throughput over both parts (15 samples
    # at half the cost, the rest at the whole); twice as fast in the rest too, they keep
    # this step's.
    def splits(fast_parts):
        return values(run_ranks(2, first_two_splits, fast_parts, tmp_path=tmp_path / str(len(fast_parts))))[0]

    first = solve_split(64, [(0.0, COST), (0.0, COST / 2)], min_per_rank=[16, 16]).sizes
    rest = first[1] - 16
    after = solve_split(64, [(0.0, COST), (0.0, (15 * COST / 2 + rest * COST) / (15 + rest))]).sizes
    assert first == (21, 43) and after == (29, 35)
    assert splits((2,)) == [list(first), list(after)]
    assert splits((2, 3)) == [list(first), list(first)]
