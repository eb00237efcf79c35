"""Balanced heterogeneous training for any model, in the user's own training loop.

A BalancedLoop owns what `hetcomm train` owns and the user's loop should not have to
write: the split of every global batch across ranks of different speeds (measured on
the first step, rebalanced while training, a straggler's samples handed off within the
step), the samples each rank draws (one permutation per epoch), micro-batching under
memory caps, the weighted gradient reduction, the loss scale and the overflow skip,
and its own checkpoint state. The user's code keeps the forward, the loss and the
optimizer step:

    loop = BalancedLoop(model, dataset, global_batch=64, collate_fn=collate)
    for step in loop.steps(1000):
        for batch in step:                         # this rank's micro-batches
            with loop.autocast():
                loss = model(**batch).loss
            step.backward(loss, count=(batch["labels"] != -100).sum())
        result = step.reduce()                     # the gradient of the global mean loss
        if not result.skipped:
            result.clip_grad_norm_(1.0)
            optimizer.step()

Sits between the communication and balancing layers (hetcomm.comm, hetcomm.balance),
which it composes, and the trainer (hetcomm.train), which is one of its clients.
"""

from hetcomm.loop.agreement import agree_precision, check_same_parameters
from hetcomm.loop.balanced_loop import BalancedLoop
from hetcomm.loop.fingerprint import fingerprint_files
from hetcomm.loop.step import LoopStep, RankRow, StepResult

__all__ = ["BalancedLoop", "LoopStep", "StepResult", "RankRow", "agree_precision", "check_same_parameters",
           "fingerprint_files"]
