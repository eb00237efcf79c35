"""The benchmark results' naming scheme (benchmarks/result_files.py)."""

import importlib.util
import json
import re
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "result_files", Path(__file__).resolve().parents[1] / "benchmarks" / "result_files.py")
result_files = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(result_files)


def test_stem_parts_in_order():
    stem = result_files.result_stem
    assert stem("allreduce", variant="1gbit") == "allreduce_1gbit_cpu"
    assert stem("allreduce", variant="0.5gbit") == "allreduce_0p5gbit_cpu"
    assert stem("hetero_cluster") == "hetero_cluster_cpu"
    assert stem("ops_cpu") == "ops_cpu"
    assert stem("ops_cuda", machine="gtx1080ti") == "ops_cuda_gtx1080ti"


def test_gpu_tag():
    assert result_files.gpu_tag("NVIDIA GeForce GTX 1080 Ti") == "gtx1080ti"
    assert result_files.gpu_tag("Tesla V100-SXM2-16GB") == "v100sxm216gb"


def test_kept_results_are_one_set_per_benchmark():
    # <benchmark>[_<variant>]_<machine>: a dated, _runN, _v2 or repeat file beside a set would be a
    # second version of it, which belongs to git history; each set has its .md.
    names = [path.name for path in result_files.RESULTS_DIR.iterdir()]
    for name in names:
        assert re.fullmatch(r"[a-z0-9]+(_[a-z0-9]+)+\.(md|json)", name), name
        assert not re.search(r"_run\d|_v\d|repeat|\d{4}-?\d{2}-?\d{2}", name), name
        assert name.removesuffix(".json") + ".md" in names or name.endswith(".md"), name


def test_repeats_are_inside_one_file():
    rows = json.loads((result_files.RESULTS_DIR / "hetero_cluster_cpu.json").read_text())
    assert sorted({r["repeat"] for r in rows}) == [0, 1, 2]
    text = (result_files.RESULTS_DIR / "hetero_cluster_cpu.md").read_text()
    assert re.findall(r"^## Repeat (\d+)$", text, re.M) == ["1", "2", "3"]


def test_write_replaces_the_set(tmp_path):
    paths = result_files.write_results(tmp_path, "demo", "| a |\n", {"a": 1})
    assert [p.name for p in paths] == ["demo_cpu.md", "demo_cpu.json"]
    result_files.write_results(tmp_path, "demo", "| b |\n", {"b": 2})
    assert (tmp_path / "demo_cpu.md").read_text().startswith("| b |\n\nWritten ")
    assert json.loads((tmp_path / "demo_cpu.json").read_text()) == {"b": 2}
    # A set written without data has no .json left over from the one before.
    result_files.write_results(tmp_path, "demo", "| c |\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo_cpu.md"]


def test_write_names_the_commit(tmp_path):
    text = result_files.write_results(tmp_path, "demo", "| a |")[0].read_text()
    assert re.search(r"\nWritten \d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC from commit \S+\.\n$", text), text


def test_write_removes_the_older_schemes_files_of_the_same_set_only(tmp_path):
    older = ["demo_cpu_2026-12-01.md", "demo_cpu_2026-12-01.json", "demo_cpu_2026-12-02_run2.md"]
    others = ["demo_common_cpu_2026-12-01.md", "demo_cpu_notes.md", "demo_v100_2026-12-01.md"]
    for name in older + others:
        (tmp_path / name).write_text("x")
    result_files.write_results(tmp_path, "demo", "| a |", [1])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["demo_cpu.md", "demo_cpu.json", *others])
