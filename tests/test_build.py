"""What the build reports about itself, and the portable (scalar) CPU loops."""

import os
import subprocess
import sys
from pathlib import Path

import torch

import hetcomm

TESTS = Path(__file__).resolve().parent


def test_info_reports_versions_backends_and_kernels():
    report = hetcomm.info()
    assert report["hetcomm"] == hetcomm.__version__
    assert report["torch"] == torch.__version__
    assert report["built_with_torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert report["backends"]["cpu"]["vector_isa"] in ("avx2+fma+f16c", "scalar")
    cuda = report["backends"]["cuda"]
    assert cuda["compiled"] == bool(cuda["archs"])
    if torch.version.cuda is None:
        assert not cuda["compiled"]
    for op in ("pack", "pack.out", "unpack_", "unscale_", "cast_", "adamw_"):
        assert "CPU" in report["kernels"][op] and "Meta" in report["kernels"][op]
    assert report["devices"][0]["device"] == "cpu"


def test_info_command_prints_json():
    result = subprocess.run([sys.executable, "-m", "hetcomm", "info"], capture_output=True, text=True, check=True)
    assert '"vector_isa"' in result.stdout and '"kernels"' in result.stdout


def test_scalar_cpu_loops_pass_the_op_tests():
    """CPUs without AVX2/F16C take the portable loops: run the CPU op tests on them."""
    env = dict(os.environ, HETCOMM_CPU_ISA="scalar")
    check = subprocess.run([sys.executable, "-c", "import hetcomm; print(hetcomm.info()['backends']['cpu'])"],
                           env=env, capture_output=True, text=True, check=True)
    assert "'scalar'" in check.stdout
    files = [str(TESTS / f"test_{name}.py") for name in ("pack", "unpack", "unscale", "cast", "adamw")]
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cpu", *files],
                            env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_unknown_cpu_isa_is_an_import_error():
    env = dict(os.environ, HETCOMM_CPU_ISA="avx9000")
    result = subprocess.run([sys.executable, "-c", "import hetcomm"], env=env, capture_output=True, text=True)
    assert result.returncode != 0
    assert "HETCOMM_CPU_ISA must be 'auto' or 'scalar'; got 'avx9000'" in result.stderr
