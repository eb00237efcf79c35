"""Time to solve the split of a global batch, from a handful of ranks (the rebalancer
solves once per step on rank 0, on the critical path) to 10,000 ranks.

    pytest benchmarks/bench_balance.py --benchmark-json=.benchmarks/balance.json
"""

import random

import pytest
import torch

from hetcomm.balance import solve_split

# (ranks, global batch): a node, a lab cluster, a large job.
PROBLEMS = [(4, 110), (64, 4096), (10_000, 400_000)]


def problem(ranks: int, global_batch: int, seed: int = 0):
    """Random per-rank profiles spanning a 10x speed range, a third of the ranks capped."""
    rng = random.Random(seed)
    profiles = [(rng.uniform(0, 0.05), rng.uniform(0.001, 0.01)) for _ in range(ranks)]
    caps = [rng.choice([None, None, global_batch // ranks // 2 + 1]) for _ in range(ranks)]
    return profiles, caps


@pytest.mark.parametrize("policy", ["accumulate", "move"])
@pytest.mark.parametrize("ranks, global_batch", PROBLEMS, ids=[f"{r}-ranks" for r, _ in PROBLEMS])
def bench_solve_split(benchmark, ranks, global_batch, policy):
    profiles, caps = problem(ranks, global_batch)
    benchmark.group = f"solve_split {ranks} ranks"
    benchmark.extra_info.update(ranks=ranks, global_batch=global_batch, policy=policy,
                                threads=torch.get_num_threads(), torch=torch.__version__)
    split = benchmark.pedantic(solve_split, args=(global_batch, profiles, caps, policy), rounds=20,
                               warmup_rounds=2, iterations=1)
    assert sum(split.sizes) == global_batch
