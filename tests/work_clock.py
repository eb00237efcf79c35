"""A clock for BalancedBatches' step timing in tests of the integrations: it advances
only with the samples a rank's model takes in training forwards, at the rank's own cost
per sample. On the shared 2-core host, 4 ranks' wall times hold their waits for a core
and the other tests' load, and a rank of a quarter of the speed once timed faster than
the others (CI: split [3, 3, 7, 3]); this clock gives each rank the time a card of its
speed would take, whatever the machine does. Install it in each rank's process, before
the first step. The wall clock's own path is the benchmarks' (bench_hf_trainer.py)."""

import torch

from hetcomm.integrations.batches import BalancedBatches


class WorkClock:
    def __init__(self, seconds_per_sample: float):
        self.seconds_per_sample = seconds_per_sample
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def count(self, samples: int) -> None:
        if torch.is_grad_enabled():   # not BalancedTrainer's no-grad probe of the loss
            self.now += self.seconds_per_sample * samples

    def count_forwards(self, model: torch.nn.Module) -> None:
        """Counts the samples of `model`'s forwards (their input_ids)."""
        model.register_forward_pre_hook(lambda module, args, kwargs: self.count(len(kwargs["input_ids"])),
                                        with_kwargs=True)


def install(seconds_per_sample: float) -> WorkClock:
    """This rank's steps timed from now on by the samples it counts, at this cost each."""
    clock = WorkClock(seconds_per_sample)
    BalancedBatches.clock = staticmethod(clock)
    return clock
