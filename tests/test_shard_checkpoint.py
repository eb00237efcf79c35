"""Ranges of sharded optimizer state on disk: written by 4 uneven ranks, read back by any
range bit for bit (4 Gloo ranks again, 3 ranks of another split, one process), every
fault named, old steps' ranges removed, a step a rank did not finish passed over."""

import multiprocessing
import os

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks, values

from hetcomm.loop import checkpoint
from hetcomm.loop.checkpoint import CheckpointError, checkpoint_path
from hetcomm.shard.checkpoint import check_step, complete, load_range, range_path, remove_unkept, save_range

TOTAL = 1000
BOUNDS = (0, 170, 340, 510, TOTAL)   # 11/11/11/32-like
MODEL = "digest-of-the-model"


def state(total=TOTAL):
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(total, generator=g) for name in ("master", "exp_avg", "exp_avg_sq")}


def bits(tensors):
    """Tensors as their bits: equal means bit for bit (-0.0, NaN payloads included)."""
    return {name: t.view(torch.int32) for name, t in tensors.items()}


def save_on_four_ranks(rank, world, directory):
    """Each Gloo rank writes its uneven range, then reads the same range back."""
    full = state()
    a, b = BOUNDS[rank], BOUNDS[rank + 1]
    save_range(directory, 5, rank, world, a, b, TOTAL, MODEL, {n: t[a:b] for n, t in full.items()})
    dist.barrier()
    got = load_range(directory, 5, a, b, TOTAL, MODEL)
    return all(torch.equal(bits(got)[n], bits(full)[n][a:b]) for n in full)


def load_on_three_ranks(rank, world, directory, bounds):
    return load_range(directory, 5, bounds[rank], bounds[rank + 1], TOTAL, MODEL)


def test_four_gloo_ranks_write_and_read_back_three_ranks_reshard(tmp_path):
    """A card removed: 4 ranks' 170/170/170/490 ranges are read by 3 ranks' 120/560/320."""
    assert values(run_ranks(4, save_on_four_ranks, tmp_path, tmp_path=tmp_path)) == [True] * 4
    new = (0, 120, 680, TOTAL)
    pieces = values(run_ranks(3, load_on_three_ranks, tmp_path, new, tmp_path=tmp_path))
    full = bits(state())
    assert [p["master"].numel() for p in pieces] == [120, 560, 320]
    for name in full:
        assert torch.equal(torch.cat([bits(p)[name] for p in pieces]), full[name])


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
        assert torch.equal(bits(got)[name], bits(full)[name][start:stop])


def test_three_ranks_read_what_four_wrote(tmp_path):
    full = write_all(tmp_path)
    new = (0, 300, 520, TOTAL)
    pieces = [load_range(tmp_path, 5, new[r], new[r + 1], TOTAL, MODEL) for r in range(3)]
    for name in full:
        assert torch.equal(torch.cat([bits(p)[name] for p in pieces]), bits(full)[name])


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
    ("other model", r"range-1-of-4.pt: the state of another model \(parameter layout other, 1,000 elements\); "
                    r"this run's model has layout digest-of-the-model, 1,000 elements"),
    ("other total", r"range-0-of-4.pt: the state of another model \(parameter layout digest-of-the-model, 1,000 "
                    r"elements\); this run's model has layout digest-of-the-model, 1,200 elements"),
    ("renamed", r"range-1-of-4.pt: holds the range of rank 2 of 4 at step 5; its name says rank 1 of 4"),
    ("not a range", r"range-3-of-4.pt: not a range of sharded state of format 1"),
    ("short", r"the ranges end at element 1,000 of 1,200"),
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
    elif fault == "renamed":
        one, two = range_path(tmp_path, 5, 1, 4), range_path(tmp_path, 5, 2, 4)
        one.unlink()
        two.rename(one)
        save_range(tmp_path, 5, 2, 4, 340, 510, TOTAL, MODEL, {n: t[340:510] for n, t in full.items()})
    elif fault == "not a range":
        checkpoint.write_verified(range_path(tmp_path, 5, 3, 4), {"step": 5}, 1)
    elif fault == "short":
        for rank in range(4):   # every range of a 1,000-element model, read as one of 1,200
            save_range(tmp_path, 5, rank, 4, BOUNDS[rank], BOUNDS[rank + 1], 1200, MODEL,
                       {n: t[BOUNDS[rank]:BOUNDS[rank + 1]] for n, t in full.items()})
    total = 1200 if fault in ("other total", "short") else TOTAL
    with pytest.raises(CheckpointError, match=message):
        load_range(tmp_path, 6 if fault == "none" else 5, 600, 1000, total, MODEL)
    # complete() reads no tensor's bytes: the rank whose range overlaps the damage finds it.
    assert complete(tmp_path, 6 if fault == "none" else 5, total, MODEL) == (fault == "flipped")


def test_a_damaged_range_is_found_by_the_rank_that_reads_it(tmp_path):
    """A rank whose new range does not overlap a file checks its values, not its bytes;
    the rank that reads the bytes finds the damage."""
    write_all(tmp_path)
    flip_a_byte(range_path(tmp_path, 5, 0, 4))
    with pytest.raises(CheckpointError, match="range-0-of-4"):
        load_range(tmp_path, 5, 0, 100, TOTAL, MODEL)


def test_ranges_of_steps_no_longer_kept_are_removed(tmp_path):
    """keep=2: writing step 7's checkpoint rotates step 3's out, and its ranges with it."""
    for step in (3, 5, 7):
        write_all(tmp_path, step)
        checkpoint.save(tmp_path, step, {"run": {}}, keep=2)
        remove_unkept(tmp_path)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == [checkpoint_path(tmp_path, s).name for s in (7, 5)]
    ranges = sorted(p.name for p in tmp_path.glob("*.range-*"))
    assert ranges == sorted(range_path(tmp_path, s, r, 4).name for s in (5, 7) for r in range(4))


def killed_while_saving(directory, full):
    """A rank killed inside its write: after the temporary file, before the rename."""
    os.replace = lambda *args: os._exit(9)
    save_range(directory, 7, 2, 4, 340, 510, TOTAL, MODEL, {n: t[340:510] for n, t in full.items()})


def test_a_step_a_rank_did_not_finish_is_passed_over(tmp_path):
    full = write_all(tmp_path, 5)
    for rank in (0, 1, 3):
        a, b = BOUNDS[rank], BOUNDS[rank + 1]
        save_range(tmp_path, 7, rank, 4, a, b, TOTAL, MODEL, {n: t[a:b] for n, t in full.items()})
    child = multiprocessing.get_context("fork").Process(target=killed_while_saving, args=(tmp_path, full))
    child.start()
    child.join()
    assert child.exitcode == 9
    temporaries = list(tmp_path.glob(f"{checkpoint.TEMPORARY_PREFIX}*.tmp"))
    assert len(temporaries) == 1
    assert [step for step in (7, 5) if complete(tmp_path, step, TOTAL, MODEL)] == [5]
    with pytest.raises(CheckpointError, match=r"step 7\): the ranges of ranks \[2\] of 4 are missing"):
        check_step(tmp_path, 7, TOTAL, MODEL)
    assert checkpoint.remove_temporaries(tmp_path) == temporaries
    assert not temporaries[0].exists()
    assert checkpoint.checkpoints(tmp_path) == []   # no range file is taken for a run's checkpoint


def test_a_range_of_the_wrong_size_is_refused_before_writing(tmp_path):
    with pytest.raises(ValueError, match=r"master has shape \(9,\); expected \(10,\)"):
        save_range(tmp_path, 1, 0, 1, 0, 10, 10, MODEL, {"master": torch.zeros(9)})
    with pytest.raises(ValueError, match=r"rank 4 of 4"):
        save_range(tmp_path, 1, 4, 4, 0, 10, 10, MODEL, {"master": torch.zeros(10)})
    assert not list(tmp_path.iterdir())


def test_a_view_is_written_alone_not_its_whole_storage(tmp_path):
    """A range sliced from a larger tensor: only its elements reach the file."""
    full = write_all(tmp_path, bounds=(0, 10, TOTAL))
    small = range_path(tmp_path, 5, 0, 2).stat().st_size
    assert small < sum(t.nbytes for t in full.values()) // 2   # 3 x 10 elements, not 3 x 1,000
