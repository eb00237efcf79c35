"""Ranges of sharded optimizer state on disk: written by 4 uneven ranks, read back by any
range bit for bit (4 ranks again, 3 ranks, one process), every fault named."""

import pytest
import torch

from hetcomm.loop.checkpoint import CheckpointError, checkpoint_path
from hetcomm.shard.checkpoint import load_range, range_path, remove_unkept, save_range

TOTAL = 1000
BOUNDS = (0, 170, 340, 510, TOTAL)   # 11/11/11/32-like
MODEL = "digest-of-the-model"


def state(total=TOTAL):
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(total, generator=g) for name in ("master", "exp_avg", "exp_avg_sq")}


def write_all(directory, step=5, bounds=BOUNDS, model=MODEL, full=None):
    full = full or state(bounds[-1])
    world = len(bounds) - 1
    for rank in range(world):
        a, b = bounds[rank], bounds[rank + 1]
        save_range(directory, step, rank, world, a, b, bounds[-1], model, {n: t[a:b] for n, t in full.items()})
    return full


@pytest.mark.parametrize("start, stop", [(0, 170), (510, 1000), (0, 1000), (100, 700), (333, 334), (0, 334)])
def test_any_range_reads_back_bit_for_bit(tmp_path, start, stop):
    full = write_all(tmp_path)
    got = load_range(tmp_path, 5, start, stop, TOTAL, MODEL)
    assert set(got) == set(full)
    for name in full:
        assert torch.equal(got[name], full[name][start:stop])


def test_three_ranks_read_what_four_wrote(tmp_path):
    full = write_all(tmp_path)
    new = (0, 300, 520, TOTAL)
    pieces = [load_range(tmp_path, 5, new[r], new[r + 1], TOTAL, MODEL) for r in range(3)]
    for name in full:
        assert torch.equal(torch.cat([p[name] for p in pieces]), full[name])


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("fault, message", [
    ("missing", r"the ranges of ranks \[2\] of 4 are missing"),
    ("mixed", r"ranges of 3 and 4 ranks are mixed"),
    ("gap", r"range \[350, 510\) leaves a gap after element 340"),
    ("overlap", r"range \[330, 510\) leaves an overlap after element 340"),
    ("flipped", r"range-3-of-4.pt: .*(does not hold what was written|not a readable)"),
    ("other model", r"the state of another model \(parameter layout other.*this run's model has layout"),
    ("none", r"no ranges of sharded optimizer state"),
])
def test_every_fault_is_named(tmp_path, fault, message):
    full = write_all(tmp_path)
    if fault == "missing":
        range_path(tmp_path, 5, 2, 4).unlink()
    elif fault == "mixed":
        save_range(tmp_path, 5, 0, 3, 0, 10, TOTAL, MODEL, {n: t[:10] for n, t in full.items()})
    elif fault in ("gap", "overlap"):
        a = 350 if fault == "gap" else 330
        save_range(tmp_path, 5, 2, 4, a, 510, TOTAL, MODEL, {n: t[a:510] for n, t in full.items()})
    elif fault == "flipped":
        flip_a_byte(range_path(tmp_path, 5, 3, 4))
    elif fault == "other model":
        save_range(tmp_path, 5, 1, 4, 170, 340, TOTAL, "other", {n: t[170:340] for n, t in full.items()})
    with pytest.raises(CheckpointError, match=message):
        load_range(tmp_path, 6 if fault == "none" else 5, 600, 1000, TOTAL, MODEL)


def test_a_damaged_range_is_found_by_the_rank_that_reads_it(tmp_path):
    """A rank whose new range does not overlap a file checks its values, not its bytes;
    the rank that reads the bytes finds the damage."""
    write_all(tmp_path)
    flip_a_byte(range_path(tmp_path, 5, 0, 4))
    with pytest.raises(CheckpointError, match="range-0-of-4"):
        load_range(tmp_path, 5, 0, 100, TOTAL, MODEL)


def test_ranges_of_steps_no_longer_kept_are_removed(tmp_path):
    for step in (3, 5):
        write_all(tmp_path, step)
    checkpoint_path(tmp_path, 5).write_bytes(b"kept")
    removed = remove_unkept(tmp_path)
    assert sorted(p.name for p in removed) == [range_path(tmp_path, 3, r, 4).name for r in range(4)]
    assert all(range_path(tmp_path, 5, r, 4).exists() for r in range(4))


def test_a_range_of_the_wrong_size_is_refused_before_writing(tmp_path):
    with pytest.raises(ValueError, match=r"master has shape \(9,\); expected \(10,\)"):
        save_range(tmp_path, 1, 0, 1, 0, 10, 10, MODEL, {"master": torch.zeros(9)})
    assert not list(tmp_path.iterdir())
