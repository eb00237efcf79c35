"""The benchmark results' naming scheme (benchmarks/result_files.py)."""

import importlib.util
import re
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "result_files", Path(__file__).resolve().parents[1] / "benchmarks" / "result_files.py")
result_files = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(result_files)


def test_stem_parts_in_order():
    stem = result_files.result_stem
    assert stem("allreduce", variant="1gbit", date="2026-11-30") == "allreduce_1gbit_cpu_2026-11-30"
    assert stem("allreduce", variant="0.5gbit", date="2026-11-30") == "allreduce_0p5gbit_cpu_2026-11-30"
    assert stem("hetero_cluster", date="2026-12-01", run=2) == "hetero_cluster_cpu_2026-12-01_run2"
    assert stem("ops_cpu", date="2026-11-29") == "ops_cpu_2026-11-29"
    assert stem("ops_cuda", machine="gtx1080ti", date="2026-11-29") == "ops_cuda_gtx1080ti_2026-11-29"


def test_gpu_tag():
    assert result_files.gpu_tag("NVIDIA GeForce GTX 1080 Ti") == "gtx1080ti"
    assert result_files.gpu_tag("Tesla V100-SXM2-16GB") == "v100sxm216gb"


def test_kept_results_follow_the_scheme():
    # <benchmark>[_<variant>]_<machine>_<date>[_run<N>]: no _v2 or _repeat versions beside the current set
    pattern = r"^[a-z0-9_]+_[a-z0-9]+_\d{4}-\d{2}-\d{2}(_run\d+)?\.(md|json)$"
    for path in (Path(__file__).resolve().parents[1] / "benchmarks" / "results").iterdir():
        assert re.match(pattern, path.name) and not re.search(r"_v\d|repeat", path.name), path.name


def test_write_refuses_to_overwrite(tmp_path):
    paths = result_files.write_results(tmp_path, "demo", "| a |\n", {"a": 1}, date="2026-12-01")
    assert [p.name for p in paths] == ["demo_cpu_2026-12-01.md", "demo_cpu_2026-12-01.json"]
    with pytest.raises(SystemExit, match="--run N"):
        result_files.write_results(tmp_path, "demo", "| a |\n", date="2026-12-01")
    assert result_files.write_results(tmp_path, "demo", "x", date="2026-12-01", run=2)[0].name == \
        "demo_cpu_2026-12-01_run2.md"
