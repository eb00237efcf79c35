"""The examples' Hugging Face models (tiny configs) trained through hetcomm.loop on 4
Gloo ranks split 1/3/5/7 equal the same global batches on one process: BERT's masked
LM weighted by masked tokens (not by samples), GPT-2's causal LM; a resumed run goes
on bit for bit; a throttled rank is rebalanced; the scripts run from the command line
and, without transformers, say what to install."""

import copy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed import run_ranks, values
from test_docs_commands import ROOT, blocks_of
from tolerances import REORDERINGS, farthest, order_bound

import work_clock
from hetcomm.balance import WeightedDistributedSampler, solve_split

transformers = pytest.importorskip("transformers", reason="the Hugging Face examples need pip install 'hetcomm[hf]'")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import hf_bert_mlm  # noqa: E402
import hf_gpt2  # noqa: E402

EXAMPLES_BY_NAME = {"bert": hf_bert_mlm, "gpt2": hf_gpt2}   # modules do not pickle to the ranks: their names do
SPLIT = [1, 3, 5, 7]
CPU = torch.device("cpu")


def arguments(example, *extra):
    return example.parser().parse_args(["--size", "tiny", "--seq", "32", "--steps", "3", "--global-batch", "16",
                                        "--dropout", "0", "--no-log", *extra])


def in_loop(rank, world, name, args, split):
    losses, model, (*_, loop) = EXAMPLES_BY_NAME[name].train(rank, world, CPU, args, split=split)
    return losses, [p.detach().clone() for p in model.parameters()], loop.split


def one_process(example, args, by_samples=None, equal=False, order=None):
    """The same steps on one process: each step's global batch in one forward, the loss
    the model's mean over all its items (the batch's samples in order(indices), if given);
    or, by_samples=[b_0, ...], each rank's part's mean weighted by its share of the
    samples (what weighting by samples would give), or with equal, by 1 / ranks (DDP's
    plain average)."""
    torch.manual_seed(args.seed)
    model = example.build_model(args.size, args.seq, args.dropout)
    decay = 0.01 if example is hf_bert_mlm else 0.1
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=decay)
    schedule = (lambda s: min(1.0, (s + 1) / args.warmup)) if example is hf_bert_mlm else (lambda s: 1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    data = (hf_bert_mlm.MaskedLMSamples(args.seq, seed=args.seed) if example is hf_bert_mlm
            else hf_gpt2.CausalLMSamples(args.seq))
    sampler = WeightedDistributedSampler(len(data), [args.global_batch], 0, seed=args.seed)
    losses = []
    for indices, _ in zip(sampler, range(args.steps)):
        indices = order(list(indices)) if order is not None else indices
        batch = torch.utils.data.default_collate([data[i] for i in indices])
        optimizer.zero_grad()
        if by_samples is None:
            loss = model(**batch).loss
        else:
            starts = [sum(by_samples[:r]) for r in range(len(by_samples))]
            loss = sum((1 / len(by_samples) if equal else b / args.global_batch)
                       * model(**{k: v[s:s + b] for k, v in batch.items()}).loss for s, b in zip(starts, by_samples))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def reference(example, args):
    """The one-process reference's losses and weights, and how far an exact run may land
    from each: order_bound of the reference on its batches in REORDERINGS."""
    losses, weights = one_process(example, args)
    reordered = [one_process(example, args, order=order) for order in REORDERINGS]
    return (losses, weights, order_bound([losses], [[other] for other, _ in reordered]),
            order_bound(weights, [other for _, other in reordered]))


def assert_equals_reference(ranks, expected_losses, expected, loss_bound, weight_bound):
    for losses, weights, *_ in ranks:
        assert farthest([losses], [expected_losses]) <= loss_bound, (losses, expected_losses, loss_bound)
        assert farthest(weights, expected) <= weight_bound, (farthest(weights, expected), weight_bound)


def test_bert_masked_lm_on_an_unequal_split_equals_one_process_weighted_by_masked_tokens(tmp_path):
    args = arguments(hf_bert_mlm)
    ranks = values(run_ranks(4, in_loop, "bert", args, SPLIT, tmp_path=tmp_path))
    expected_losses, expected, loss_bound, weight_bound = reference(hf_bert_mlm, args)
    assert_equals_reference(ranks, expected_losses, expected, loss_bound, weight_bound)
    # The ranks' masked-token counts differ: weighting by samples lands elsewhere.
    _, by_samples = one_process(hf_bert_mlm, args, by_samples=SPLIT)
    assert farthest(ranks[0][1], by_samples) > 5 * weight_bound


def test_gpt2_on_an_unequal_split_equals_one_process(tmp_path):
    args = arguments(hf_gpt2)
    ranks = values(run_ranks(4, in_loop, "gpt2", args, SPLIT, tmp_path=tmp_path))
    expected_losses, expected, loss_bound, weight_bound = reference(hf_gpt2, args)
    assert_equals_reference(ranks, expected_losses, expected, loss_bound, weight_bound)
    # DDP's plain average of the ranks' means lands elsewhere.
    _, averaged = one_process(hf_gpt2, args, by_samples=SPLIT, equal=True)
    assert farthest(ranks[0][1], averaged) > 5 * weight_bound


def interrupted(rank, world, args, split):
    """Two steps, a checkpoint's worth of state, then two more from that state in a
    fresh model, optimizer and loop."""
    first = copy.copy(args)
    first.steps = 2
    losses, model, (optimizer, loop) = hf_gpt2.train(rank, world, CPU, first, split=split)
    state = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                           "loop": loop.state_dict()})
    more, resumed, _ = hf_gpt2.train(rank, world, CPU, args, split=split, state=state)
    return losses + more, [p.detach().clone() for p in resumed.parameters()]


def test_a_resumed_gpt2_run_continues_bit_for_bit(tmp_path):
    args = arguments(hf_gpt2, "--steps", "4")
    straight_losses, straight, _ = values(run_ranks(2, in_loop, "gpt2", args, [5, 11], tmp_path=tmp_path))[0]
    losses, resumed = values(run_ranks(2, interrupted, args, [5, 11], tmp_path=tmp_path / "r"))[0]
    assert losses == straight_losses
    assert all(torch.equal(a, b) for a, b in zip(resumed, straight))


COST = 0.01          # seconds a sample, forward and backward, on the work clock
THROTTLE_STEP = 4    # rank 1 at a tenth of its speed from this step on


def throttled_bert(rank, world, args):
    """in_loop for BERT timed by the work clock (tests/work_clock.py): a quarter of a
    sample's cost at its forward, the rest at its backward; rank 1 ten times slower from
    THROTTLE_STEP on (counted by the optimizer's steps). The splits of every step too."""
    clock = work_clock.install(COST)
    build, optimizer_class = hf_bert_mlm.build_model, torch.optim.AdamW

    def timed_model(*options):
        model = build(*options)
        clock.count_passes(model, 0.25)
        return model

    class Throttling(optimizer_class):
        def step(self, *a, **k):
            self.done = getattr(self, "done", 0) + 1
            if rank == 1 and self.done == THROTTLE_STEP:
                clock.seconds_per_sample = COST * 10
            return super().step(*a, **k)

    hf_bert_mlm.build_model, torch.optim.AdamW = timed_model, Throttling   # this rank's process only
    splits = []
    original_record = hf_bert_mlm.StepLog.record
    hf_bert_mlm.StepLog.record = lambda log, result: (splits.append([r.samples for r in result.ranks]),
                                                      original_record(log, result))
    losses, model, (*_, loop) = hf_bert_mlm.train(rank, world, CPU, args)
    return losses, [p.detach().clone() for p in model.parameters()], splits


def test_a_throttled_bert_rank_is_rebalanced_and_trains_as_one_process(tmp_path):
    args = arguments(hf_bert_mlm, "--steps", "8")
    losses, weights, splits = values(run_ranks(2, throttled_bert, args, tmp_path=tmp_path))[0]
    # Equal ranks keep the equal split. The throttled step runs as dealt: four steps have
    # not taught the handoff what part of a sample's time its forward is (test_loop.py
    # throttles after six, and hands off); the rebalancer then moves to the best split
    # for a tenth of the speed, 15 / 1, at the next step.
    best = solve_split(16, [(0.0, COST), (0.0, 10 * COST)]).sizes
    assert best == (15, 1)
    assert splits == [[8, 8]] * (THROTTLE_STEP + 1) + [list(best)] * 3, str(splits)
    expected_losses, expected, loss_bound, weight_bound = reference(hf_bert_mlm, args)
    assert_equals_reference([(losses, weights)], expected_losses, expected, loss_bound, weight_bound)


def test_the_examples_say_what_to_install_without_transformers():
    for script in ("hf_bert_mlm.py", "hf_gpt2.py"):
        run = subprocess.run([sys.executable, "-c", "import runpy, sys; sys.modules['transformers'] = None; "
                              f"sys.argv = ['{script}', '--steps', '1']; "
                              f"runpy.run_path({str(EXAMPLES / script)!r}, run_name='__main__')"],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 1 and "pip install 'hetcomm[hf]'" in run.stderr and "Traceback" not in run.stderr


def documented_example_commands() -> list[str]:
    """The commands of docs/guide.md's block that runs the examples (marked not run there:
    this test runs them, as printed)."""
    block = next(b for b in blocks_of(ROOT / "docs" / "guide.md") if "python examples/plain_pytorch.py" in b.code)
    return [line for line in block.code.splitlines() if line.strip()]


def test_the_documented_example_commands_run_and_learn():
    commands = documented_example_commands()
    assert [shlex.split(c)[1] for c in commands] == ["examples/plain_pytorch.py", "examples/hf_bert_mlm.py",
                                                      "examples/hf_gpt2.py"]
    for command in commands:
        argv = [sys.executable, *shlex.split(command)[1:]]
        run = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert run.returncode == 0, f"{command}\n{run.stderr[-3000:]}"
        if "plain_pytorch" in command:
            losses = [float(line.split("loss ")[1].split(",")[0]) for line in run.stdout.splitlines()]
            assert len(losses) == 4 and losses[-1] < losses[0] / 2, run.stdout
        else:   # --steps 3: a line for each step
            steps = [line.split()[1] for line in run.stdout.splitlines() if line.startswith("step")]
            assert steps == ["0", "1", "2"], run.stdout
    assert len((EXAMPLES / "plain_pytorch.py").read_text().splitlines()) <= 60
