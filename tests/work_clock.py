"""A clock for the step timing of BalancedLoop and the integrations' BalancedBatches in
tests (hetcomm.balance.profile.TimedSteps.clock, which both read): it advances only with
the samples a rank's model takes in training passes, at the rank's own cost per sample.
On the shared 2-core host, 4 ranks' wall times hold their waits for a core and the other
tests' load, and a rank of a quarter of the speed once timed faster than the others (CI:
split [3, 3, 7, 3]); this clock gives each rank the time a card of its speed would take,
whatever the machine does, so that a test can assert the split the solver's math gives.
Install it in each rank's process, before the first step. The wall clock's own path is
the benchmarks' and the examples' (bench_hf_trainer.py, examples/plain_pytorch.py)."""

import torch

from hetcomm.balance.profile import TimedSteps


class WorkClock:
    def __init__(self, seconds_per_sample: float):
        self.seconds_per_sample = seconds_per_sample   # a test may change it as the run goes (a throttle)
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def count(self, samples: int, part: float = 1.0) -> None:
        self.now += part * self.seconds_per_sample * samples

    def count_forwards(self, model: torch.nn.Module) -> None:
        """Counts the samples of `model`'s training forwards (their input_ids), each at
        the whole cost of a sample."""
        def forward(module, args, kwargs):
            if torch.is_grad_enabled():   # not BalancedTrainer's no-grad probe of the loss
                self.count(len(kwargs["input_ids"]))

        model.register_forward_pre_hook(forward, with_kwargs=True)

    def count_passes(self, model: torch.nn.Module, forward_part: float) -> None:
        """Counts the samples of `model`'s training forwards (its first argument's rows, or
        its input_ids')
        at `forward_part` of a sample's cost, and of its backwards at the rest (a
        backward runs in no-grad mode, and only for a forward kept), so that the time
        of a first micro-batch's forward, which the handoff predicts a share from, is
        a part of the share's time as on a device."""
        def forward(module, args, kwargs):
            if torch.is_grad_enabled():
                self.count(len(args[0] if args else kwargs["input_ids"]), forward_part)

        model.register_forward_pre_hook(forward, with_kwargs=True)
        model.register_full_backward_pre_hook(lambda module, grads: self.count(len(grads[0]), 1 - forward_part))


def install(seconds_per_sample: float) -> WorkClock:
    """This rank's steps timed from now on by the samples it counts, at this cost each."""
    clock = WorkClock(seconds_per_sample)
    TimedSteps.clock = staticmethod(clock)
    return clock
