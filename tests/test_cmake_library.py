"""The CMake-built library (for C++ users) registers the same ops as hetcomm._C.

CMake's find_package(Torch) needs a full CUDA toolkit when torch is a CUDA build, so
this test takes a library built beforehand: .ci/run builds it against CPU-only torch
and sets HETCOMM_CMAKE_LIBRARY. Build it yourself with the commands in CMakeLists.txt.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hetcomm  # noqa: F401  (registers the ops in this process, for the schema comparison)

LIBRARY = os.environ.get("HETCOMM_CMAKE_LIBRARY")
REFERENCE = Path(hetcomm.__file__).with_name("reference.py")

# Runs in a fresh interpreter: loading both hetcomm._C and the CMake library into one
# process would register the hetcomm namespace twice.
CHILD = r"""
import importlib.util, json, sys
import torch
torch.ops.load_library(sys.argv[1])
spec = importlib.util.spec_from_file_location("reference", sys.argv[2])
reference = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reference)

ops = torch.ops.hetcomm
src = [torch.randn(769), torch.randn(3, 5).half(), torch.randn(33).bfloat16()]
scale = torch.tensor([0.75])
packed = ops.pack.default(src, scale, torch.float16)
assert torch.equal(packed, reference.pack(src, scale, torch.float16))

dst = [torch.empty(769), torch.empty(15), torch.empty(33)]
ref_dst = [torch.empty(769), torch.empty(15), torch.empty(33)]
found, norm, ref_found, ref_norm = (torch.zeros(1) for _ in range(4))
packed[3] = float("inf")
ops.unpack_.default(packed, dst, scale, found, norm)
reference.unpack_(packed, ref_dst, scale, ref_found, ref_norm)
assert all(torch.equal(a, b) for a, b in zip(dst, ref_dst)) and found.item() == ref_found.item() == 1.0

names = ["pack", "unpack_", "unscale_", "cast_"]
schemas = [str(getattr(ops, n).default._schema) for n in names] + [str(ops.pack.out._schema)]
print(json.dumps(schemas))
"""


@pytest.mark.skipif(LIBRARY is None, reason="set HETCOMM_CMAKE_LIBRARY to a CMake-built libhetcomm_ops.so")
def test_cmake_library_gives_the_same_ops():
    result = subprocess.run([sys.executable, "-c", CHILD, LIBRARY, str(REFERENCE)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    ops = torch.ops.hetcomm
    expected = [str(getattr(ops, n).default._schema) for n in ["pack", "unpack_", "unscale_", "cast_"]]
    expected.append(str(ops.pack.out._schema))
    assert json.loads(result.stdout.strip().splitlines()[-1]) == expected
