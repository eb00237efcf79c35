"""benchmarks/gpu_full_shard.py: the plans it measures a GPU against, and its run on the
CPU at tiny sizes (the code path the GPU run takes, without the memory figures)."""

import math

import pytest
from conftest import import_benchmark
from distributed import run_ranks, values

import torch


@pytest.fixture(scope="module")
def script():
    return import_benchmark("gpu_full_shard")


def test_every_case_has_a_plan_for_one_1080ti(script):
    """What the GPU run trains: the cases fit one 1080 Ti fully sharded with the optimizer
    offloaded, gpt2-774m without checkpointing, the Llama-3.2-1B shape with it."""
    planned = {(case.model, case.seq): script.card_plan(case, "1080ti")[1] for case in script.CASES}
    assert {key: (card.micro_batch, card.checkpointing) for key, card in planned.items()} == {
        ("gpt2-774m", 1024): (2, False), ("llama-3.2-1b", 1024): (2, True), ("llama-3.2-1b", 2048): (1, True)}
    for card in planned.values():
        assert card.held_bytes <= card.usable_bytes and card.state_bytes == 0


def tiny_rows(rank, world):
    script = import_benchmark("gpu_full_shard")
    return [script.run_case(case, "1080ti", torch.device("cpu"), 2) for case in script.TINY]


def test_the_tiny_cases_train_on_cpu_ranks(script, tmp_path):
    rows = values(run_ranks(1, tiny_rows, tmp_path=tmp_path))[0]
    assert [row["model"] for row in rows] == ["tiny-gpt", "tiny-llama"]
    for row, case in zip(rows, script.TINY):
        member, card = script.card_plan(case, "1080ti")
        assert row["planned_bytes"] == card.held_bytes - card.context_bytes
        assert row["micro_batch"] == card.micro_batch and row["elements"] == card.elements
        assert len(row["losses"]) == 2 and all(math.isfinite(x) for x in row["losses"])
        assert row["host_bytes"] == 18 * card.elements   # the offloaded state, 18 B an element
        assert "peak_allocated" not in row   # measured on a GPU only
