"""A pure-Python install (HETCOMM_BUILD_EXT=0, no hetcomm._C): the ops are defined in
Python with the compiled ops' schemas, give their bits and their errors on CPU, and
hetcomm says so once on import.

Each check runs in a fresh interpreter that hides hetcomm._C before importing hetcomm;
the compiled ops of this process give the expected answers.
"""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import assert_same_bits, make_tensors, scalar, special_values

import hetcomm

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
OPS = ("pack.default", "pack.out", "unpack_.default", "unscale_.default", "cast_.default", "adamw_.default",
       "_set_launch_shape.default", "_clear_launch_shape.default")

# Makes the interpreter look like a pure-Python install: importing hetcomm._C fails
# as it does when the file is absent.
HIDE_COMPILED = f"""
import sys

class HideCompiled:
    def find_spec(self, name, path=None, target=None):
        if name == "hetcomm._C":
            raise ModuleNotFoundError("No module named 'hetcomm._C'", name="hetcomm._C")
        return None

sys.meta_path.insert(0, HideCompiled())
sys.path.insert(0, {str(TESTS)!r})
"""

# Fails the run if hetcomm loaded its compiled operators after all.
CHECK_PURE = "\nimport hetcomm\nassert not hetcomm._extension.COMPILED, 'hetcomm._C was not hidden'\n"


def run_pure(code: str, acknowledge: bool = True) -> str:
    """Runs `code` in a pure-Python hetcomm; returns its stdout."""
    env = dict(os.environ)
    env.pop("HETCOMM_PURE_PYTHON", None)
    if acknowledge:
        env["HETCOMM_PURE_PYTHON"] = "1"
    result = subprocess.run([sys.executable, "-c", HIDE_COMPILED + code + CHECK_PURE], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def schemas() -> dict[str, str]:
    return {op: str(getattr(getattr(torch.ops.hetcomm, op.split(".")[0]), op.split(".")[1])._schema) for op in OPS}


def make_inputs() -> dict:
    """Mixed-dtype tensors of odd sizes with rounding ties, subnormals and overflows."""
    shapes = [(3, 5), (769,), (0,), (9,)]
    src = [t for dtype in (torch.float32, torch.float16, torch.bfloat16) for t in make_tensors(shapes, dtype, "cpu")]
    src += [special_values(dtype) for dtype in (torch.float32, torch.float16, torch.bfloat16)]
    total = sum(t.numel() for t in src)
    return {"src": src, "scale": scalar(0.37), "inv_scale": scalar(1 / 0.37),
            "flat": (torch.randn(total, generator=torch.Generator().manual_seed(5)) * 100).half(),
            "special_flat": torch.cat([t.flatten().float() * 3 for t in src]).bfloat16()}


def run_ops(inputs: dict) -> dict:
    """Every op on `inputs` (left untouched); returns the tensors each wrote."""
    src, scale, inv_scale = inputs["src"], inputs["scale"], inputs["inv_scale"]
    total = sum(t.numel() for t in src)
    out = {"pack": [hetcomm.pack(src, scale, torch.float16)],
           "pack.out": [hetcomm.pack(src, scale, out=torch.empty(total, dtype=torch.bfloat16))]}
    for name in ("flat", "special_flat"):
        dst, found_inf, sq_norm = [torch.empty_like(t) for t in src], torch.zeros(1), torch.zeros(1)
        hetcomm.unpack_(inputs[name], dst, inv_scale, found_inf, sq_norm)
        out[f"unpack_ {name}"] = [*dst, found_inf, sq_norm]
    tensors, found_inf = [t.clone() for t in src], torch.zeros(1)
    hetcomm.unscale_(tensors, inv_scale, found_inf)
    out["unscale_"] = [*tensors, found_inf]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        dst = [torch.empty(t.shape, dtype=dtype) for t in src]
        hetcomm.cast_(src, dst)
        out[f"cast_ to {dtype}"] = dst
    masters = [t.float() * 0.1 for t in src]
    avg, sq = [t * 0.01 for t in masters], [t * t * 1e-3 for t in masters]
    copies = [torch.empty(t.shape, dtype=torch.bfloat16) for t in src]
    hetcomm.adamw_(src, masters, avg, sq, copies, grad_scale=inv_scale, step=scalar(3.0), lr=1e-3, weight_decay=0.1)
    out["adamw_"] = [*masters, *avg, *sq, *copies]
    return out


BAD_CALLS = {
    "empty list": lambda: hetcomm.pack([], scalar(1.0)),
    "no tensor at all": lambda: hetcomm.cast_([], []),
    "flat of the wrong numel": lambda: hetcomm.unpack_(torch.randn(8), [torch.zeros(3), torch.zeros(4)], 1.0,
                                                       torch.zeros(1)),
    "scale of the wrong dtype": lambda: hetcomm.pack([torch.randn(3)], torch.ones(1, dtype=torch.float64)),
    "non-contiguous": lambda: hetcomm.unscale_([torch.randn(3), torch.randn(4, 5).t()], 1.0, torch.zeros(1)),
    "int32 destination": lambda: hetcomm.cast_([torch.randn(3)], [torch.zeros(3, dtype=torch.int32)]),
    "shapes differ": lambda: hetcomm.cast_([torch.randn(3, 2)], [torch.randn(6)]),
    "out aliases src": lambda: (lambda b: hetcomm.pack([b[0:4]], 1.0, out=b[2:6]))(torch.randn(8)),
    "dst aliases flat": lambda: (lambda b: hetcomm.unpack_(b[0:4], [b[3:7]], 1.0, torch.zeros(1)))(torch.randn(8)),
    "adamw_ NaN lr": lambda: hetcomm.adamw_([torch.randn(3)], [torch.randn(3)], [torch.zeros(3)], [torch.zeros(3)],
                                            step=scalar(1.0), lr=float("nan")),
    "adamw_ flat gradient short": lambda: hetcomm.adamw_([torch.randn(4)], [torch.randn(3), torch.randn(2)],
                                                         [torch.zeros(3), torch.zeros(2)],
                                                         [torch.zeros(3), torch.zeros(2)], step=scalar(1.0), lr=0.1),
    "adamw_ copy over master": lambda: (lambda m: hetcomm.adamw_([torch.randn(3)], [m], [torch.zeros(3)],
                                                                 [torch.zeros(3)], [m], step=scalar(1.0), lr=0.1))(
        torch.randn(3)),
    # The fallback that runs on a device without a kernel (CUDA tensors under backend="native"
    # in a pure-Python install), called directly: this machine may have no such device.
    "no kernel for the device": lambda: torch.ops.hetcomm.unscale_.default._op_dk(
        torch._C.DispatchKey.CompositeExplicitAutograd, [torch.randn(3)], scalar(1.0), torch.zeros(1)),
    "no kernel, bad argument": lambda: torch.ops.hetcomm.pack.out._op_dk(
        torch._C.DispatchKey.CompositeExplicitAutograd, [torch.randn(3)], scalar(1.0), out=torch.empty(4)),
}


def run_bad_calls() -> dict[str, list[str]]:
    """The exception type and message of each bad call."""
    raised = {}
    for name, call in BAD_CALLS.items():
        try:
            call()
        except Exception as error:  # the type and message are what is compared
            raised[name] = [type(error).__name__, str(error)]
        else:
            raised[name] = ["no error", ""]
    return raised


def test_warns_once_unless_acknowledged():
    code = """
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import hetcomm
    import hetcomm.ops
report = hetcomm.info()
print(json.dumps({"warnings": [[w.category.__name__, issubclass(w.category, UserWarning), str(w.message)]
                               for w in caught],
                  "install": report["install"], "isa": report["backends"]["cpu"]["vector_isa"],
                  "built_with_torch": report["built_with_torch"], "kernels": report["kernels"],
                  "native": sorted(hetcomm.ops._NATIVE_DEVICE_TYPES)}))
"""
    warned = json.loads(run_pure(code, acknowledge=False))
    assert len(warned["warnings"]) == 1
    category, is_user_warning, message = warned["warnings"][0]
    assert category == "PurePythonWarning" and is_user_warning
    for part in ("no compiled operators", "reference", "Triton", "pip install --no-build-isolation",
                 "HETCOMM_PURE_PYTHON=1"):
        assert part in message
    assert warned["install"] == "pure-python" and warned["built_with_torch"] is None
    assert warned["isa"] == "none (pure-Python install)"
    # CPU kernels only, so "auto" sends CUDA tensors to Triton; cast_ and adamw_ run anywhere.
    assert warned["native"] == ["cpu"]
    assert warned["kernels"]["pack"] == ["CPU", "Meta", "CompositeExplicitAutograd"]
    assert warned["kernels"]["cast_"] == warned["kernels"]["adamw_"] == ["Meta", "CompositeExplicitAutograd"]
    assert json.loads(run_pure(code))["warnings"] == []


@pytest.mark.parametrize("failure", [
    'ImportError("hetcomm/_C.so: undefined symbol: _ZN3c10")',
    'ModuleNotFoundError("No module named \'libhetcomm_helper\'", name="libhetcomm_helper")',
], ids=["undefined symbol", "missing dependency"])
def test_a_broken_build_is_an_error_not_a_fallback(failure):
    """Only a missing hetcomm._C means a pure-Python install; one that fails to load is an error."""
    code = f"""
import sys, warnings

class BreakCompiled:
    def find_spec(self, name, path=None, target=None):
        if name == "hetcomm._C":
            raise {failure}
        return None

sys.meta_path.insert(0, BreakCompiled())
warnings.simplefilter("error")
import hetcomm
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "hetcomm's compiled operators (hetcomm._C) could not be loaded" in result.stderr
    assert "no compiled operators in this install" not in result.stderr


def test_schemas_are_the_compiled_ones():
    assert hetcomm.info()["install"] == "compiled"
    out = run_pure("import json\nfrom test_pure_python import schemas\nprint(json.dumps(schemas()))")
    assert json.loads(out) == schemas()


def test_cpu_results_are_the_compiled_bits(tmp_path):
    inputs = make_inputs()
    torch.save(inputs, tmp_path / "inputs.pt")
    run_pure(f"import torch\nfrom test_pure_python import run_ops\n"
             f"inputs = torch.load({str(tmp_path / 'inputs.pt')!r})\n"
             f"torch.save(run_ops(inputs), {str(tmp_path / 'pure.pt')!r})")
    pure, compiled = torch.load(tmp_path / "pure.pt"), run_ops(inputs)
    assert pure.keys() == compiled.keys()
    assert compiled["unpack_ special_flat"][-2].item() == 1.0 and compiled["unscale_"][-1].item() == 1.0
    for name, expected in compiled.items():
        for got, want in zip(pure[name], expected, strict=True):
            assert_same_bits(got, want)


def test_bad_calls_raise_the_compiled_errors():
    pure = json.loads(run_pure("import json\nfrom test_pure_python import run_bad_calls\n"
                               "print(json.dumps(run_bad_calls()))"))
    compiled = run_bad_calls()
    assert all(kind != "no error" for kind, _ in compiled.values())
    assert pure == compiled


def test_weighted_reducer_on_one_gloo_rank():
    code = """
import torch
import torch.distributed as dist
from distributed import free_port
from tiny_model import COUNTS, TinyNet, local_backward
from tolerances import UNIT_ROUNDOFF, apart, sq_norm_rtol, sqrt_rtol, sum_rtol
import hetcomm

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
model = TinyNet()
local_backward(model, 0, COUNTS, use_side=True)
used = [p for p in model.parameters() if p.grad is not None]
before = [p.grad.clone() for p in used]
reducer = hetcomm.WeightedReducer(used, wire_dtype=torch.float16)
result = reducer.reduce(weight=1.0)
assert result.found_inf.item() == 0.0
for p, g in zip(used, before, strict=True):
    # One rank, weight 1: the only change is the round trip through the fp16 wire.
    assert torch.equal(p.grad, g.half().float()), (p.grad - g).abs().max()
# The reference's sq_norm (float64 sums of exact squares, to fp32, added in fp32 once per
# bucket) and its fp32 root, against float64 throughout.
expected_norm = torch.cat([g.half().double().flatten() for g in before]).norm()
n = sum(g.numel() for g in before)
ours = sqrt_rtol(sq_norm_rtol(n, additions=len(reducer.buckets)))
rtol = apart(ours, sum_rtol(n, torch.float64) + UNIT_ROUNDOFF[torch.float64])
torch.testing.assert_close(result.grad_norm.double(), expected_norm, rtol=rtol, atol=0)
dist.destroy_process_group()
print("ok")
"""
    assert run_pure(code).strip() == "ok"


def test_opcheck_on_the_python_ops():
    code = """
import pytest
import torch
from conftest import make_tensors, scalar
import hetcomm

ops = torch.ops.hetcomm
src = make_tensors([(3, 5), (769,), (0,)], torch.float32, "cpu")
torch.library.opcheck(ops.pack.default, (src, scalar(0.5), torch.float16))
torch.library.opcheck(ops.pack.out, (src, scalar(0.5)), {"out": torch.empty(784, dtype=torch.bfloat16)})
flat, found_inf, sq_norm = torch.randn(784).bfloat16(), torch.zeros(1), torch.zeros(1)
torch.library.opcheck(ops.unpack_.default, (flat, src, scalar(0.5), found_inf, sq_norm))
torch.library.opcheck(ops.unpack_.default, (flat, src, scalar(0.5), found_inf))
torch.library.opcheck(ops.unscale_.default, (src, scalar(0.5), found_inf))
torch.library.opcheck(ops.cast_.default, (src, [torch.empty(t.shape, dtype=torch.float16) for t in src]))
print("ok")
"""
    assert run_pure(code).strip() == "ok"


def test_the_cpu_op_tests_pass_on_the_python_ops():
    """The op tests of the compiled install, on the Python-defined ops (as in test_build's scalar run)."""
    files = [str(TESTS / f"test_{name}.py") for name in ("bad_input", "pack", "unpack", "unscale", "cast", "adamw",
                                                                  "compile")]
    args = ["-q", "-p", "no:cacheprovider", "-k", "cpu or bad_input or compile", *files]
    out = run_pure(f"import pytest\ncode = pytest.main({args!r})\nassert code == 0, code")
    assert " passed" in out and "failed" not in out


def test_build_ext_0_makes_a_pure_python_wheel(tmp_path):
    """HETCOMM_BUILD_EXT=0 builds a py3-none-any wheel with no compiled file."""
    source = tmp_path / "source"
    # The source tree without build outputs, whether or not it is a git checkout (CI tests a plain copy).
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "runs", ".benchmarks", "__pycache__", "*.so", "*.egg-info",
        ".pytest_cache", ".ruff_cache", "gpu-results"))
    env = dict(os.environ, HETCOMM_BUILD_EXT="0", PIP_DISABLE_PIP_VERSION_CHECK="1")
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                             "-w", str(tmp_path / "wheels"), "."], cwd=source, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    wheels = list((tmp_path / "wheels").glob("*.whl"))
    assert len(wheels) == 1 and wheels[0].name.endswith("-py3-none-any.whl"), wheels
    names = zipfile.ZipFile(wheels[0]).namelist()
    assert not [n for n in names if n.endswith((".so", ".pyd", ".dll"))]
    assert {"hetcomm/plan/devices.csv", "hetcomm/_python_ops.py", "hetcomm/checks.py"} <= set(names)
