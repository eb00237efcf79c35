"""benchmarks/sweep_launch.py on the emulated GPUs: every shape of the sweep computes
what the reference does and launches the grid it asks for, its override of the launch
shape ends with its block, a shape the op refuses is reported as refused, and a shape
that computes wrong is reported as wrong and never timed. The override itself:
tests/test_launch_shape.py."""

import json

import cuda_emulator
import pytest
import torch
from conftest import import_benchmark, make_tensors, scalar

sweep = import_benchmark("sweep_launch")
ops = torch.ops.hetcomm
CHUNK = 8192  # kChunk in csrc/kernels/launch_args.h


def test_every_shape_of_the_sweep_computes_right_on_the_emulator(tmp_path):
    # sm75: 2 SMs, the table's 4 blocks per SM and 4 items; 12 chunks, more than any grid.
    args = ["--emulator", "sm75", "--out", str(tmp_path), "--elements", str(12 * CHUNK), "--tensors", "4",
            "--blocks", "1", "3", "--reps", "1"]
    assert sweep.main(args) == 0
    data = json.loads((tmp_path / "sweep_launch_emulated-sm75_cpu.json").read_text())
    rows = data["rows"]
    assert [r["status"] for r in rows] == ["ok"] * len(rows)
    shapes = [(None, None), (1, 2), (1, 4), (3, 2), (3, 4)]
    expected = [(case.name, shape) for case in sweep.CASES
                for shape in (shapes if case.has_items else [(None, None), (1, None), (3, None)])]
    assert [(r["case"], (r["blocks_per_sm"], r["items_per_thread"])) for r in rows] == expected
    grids = {None: 8, 1: 2, 3: 6}  # 2 SMs x blocks per SM
    assert all(r["grid"] == grids[r["blocks_per_sm"]] for r in rows)
    text = (tmp_path / "sweep_launch_emulated-sm75_cpu.md").read_text()
    assert "emulated sm75" in data["environment"]["gpu"] and "sm75" in text.splitlines()[0]
    assert "meaningless for bandwidth" in text and f"**{len(rows)} of {len(rows)} shapes computed right**" in text


def test_the_sweep_s_override_ends_with_its_block_even_on_error():
    gpu = cuda_emulator.emulated_gpu("sm80")  # 3 SMs; the table's 8 blocks per SM, 5 of them resident
    src = make_tensors([(40 * CHUNK,)], torch.float32, "cpu")

    def grids():
        gpu.take_recent_launches()
        ops.pack(src, scalar(1.0), torch.float16)
        return [launch.grid for launch in gpu.take_recent_launches()]

    with gpu.running():
        with pytest.raises(ZeroDivisionError), sweep.launch_shape(1, 4):
            assert grids() == [3]
            1 / 0
        assert grids() == [15]


def test_the_sweep_reports_a_refused_shape_and_times_the_rest(tmp_path):
    args = ["--emulator", "sm61", "--out", str(tmp_path), "--ops", "cast_", "--elements", str(4 * CHUNK),
            "--tensors", "2", "--blocks", "0", "1", "--items", "2", "3", "--reps", "1"]
    assert sweep.main(args) == 0
    rows = json.loads((tmp_path / "sweep_launch_emulated-sm61_cpu.json").read_text())["rows"]
    statuses = {(r["blocks_per_sm"], r["items_per_thread"]): r["status"]
                for r in rows if r["case"] == "cast_ fp32->fp16"}
    assert statuses[None, None] == statuses[1, 2] == "ok"
    assert "blocks_per_sm must be" in statuses[0, 2] and "blocks_per_sm must be" in statuses[0, 3]
    assert "items_per_thread must be 2 or 4" in statuses[1, 3]
    assert all("median_ms" not in r for r in rows if r["status"] != "ok")


@pytest.mark.parametrize("op, spoil, why", [
    ("pack", lambda w: w.wire[-1:].fill_(0.0), "1 of 1 outputs differ from the reference's"),
    ("unpack_", lambda w: w.sq_norm.mul_(1.001), "further than its error bound"),
])
def test_a_shape_that_computes_wrong_is_reported_and_never_timed(op, spoil, why):
    case = next(c for c in sweep.CASES if c.op == op)
    device = sweep.Emulator("sm61")
    with device.gpu.running():
        workload = sweep.WORKLOADS[op](case, [5000, 3 * CHUNK + 1], "cpu")
        run = workload.run
        workload.run = lambda: (run(), spoil(workload))
        rows = sweep.measure_case(device, case, workload, sweep.shapes_of(case, [1], [2]), reps=1,
                                  elements=3 * CHUNK + 5001, copy_ms=1.0)
    assert [r["status"].split(":")[0] for r in rows] == ["wrong", "wrong"]
    assert all(why in r["status"] and "median_ms" not in r for r in rows)
