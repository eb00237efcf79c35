"""Shared test inputs: dtypes, odd sizes, GPT-shaped parameter lists, devices; the
benchmark scripts as modules."""

import importlib
import os
import sys
from pathlib import Path

import cuda_emulator
import pytest
import torch
from torch.autograd import DeviceType

if not torch.cuda.is_available():
    # Without a GPU, the Triton kernels run on CPU tensors in Triton's interpreter.
    # Triton picks the interpreter when a kernel is decorated, so this must be set
    # before anything imports hetcomm.triton.
    os.environ["TRITON_INTERPRET"] = "1"

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# Odd sizes, sizes around the 8-wide vector step, and sizes that straddle the CPU
# back end's 32768-element work chunks.
ODD_SIZES = [1, 7, 8, 9, 769, 5125, 32768 * 2 + 5]

# The back ends the op tests run against, each named by a `device` parameter (see the
# fixture below): the CPU kernels; the CUDA kernels on a real GPU; the same CUDA kernels
# compiled for emulated sm_61, sm_75 and sm_80 GPUs and run on CPU tensors by
# tests/cuda_emulator, under three thread schedules; and the Triton kernels (in Triton's
# interpreter on CPU tensors without a GPU).
REAL_GPU = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))
EMULATED_GPUS = [f"emu-{gpu}-{schedule}" for gpu in cuda_emulator.GPUS for schedule in cuda_emulator.SCHEDULES]
CUDA_DEVICES = [REAL_GPU, *EMULATED_GPUS]
NATIVE_DEVICES = ["cpu", *CUDA_DEVICES]  # what has a cast_ kernel
DEVICES = [*NATIVE_DEVICES, "triton"]


@pytest.fixture
def device(request):
    """The device of a test's tensors, with the back end that its `device` parameter
    names switched on for the test: "cpu" and "cuda" as they are; "emu-<gpu>-<schedule>"
    binds the emulated GPU's CUDA kernels to the hetcomm ops on CPU tensors; "triton"
    makes the Triton kernels the default back end. Tests take it through
    @pytest.mark.parametrize("device", DEVICES, indirect=True)."""
    target = request.param
    if target.startswith("emu-"):
        _, gpu, schedule = target.split("-", 2)
        with cuda_emulator.emulated_gpu(gpu).running(schedule):
            yield "cpu"
    elif target == "triton":
        pytest.importorskip("triton")
        import hetcomm  # here, not at the top: TRITON_INTERPRET must be set first

        previous = hetcomm.get_backend()
        hetcomm.set_backend("triton")
        try:
            yield "cuda" if torch.cuda.is_available() else "cpu"
        finally:
            hetcomm.set_backend(previous)
    else:
        yield target


@pytest.fixture
def count_launches(request, device):
    """count_launches(run) -> the number of hetcomm kernels that run() launches on the
    test's CUDA device: counted by the profiler on a GPU, by the emulator otherwise."""
    target = request.node.callspec.params["device"]
    if target.startswith("emu-"):
        gpu = cuda_emulator.emulated_gpu(target.split("-")[1])

        def count(run) -> int:
            before = gpu.launches()
            run()
            return gpu.launches() - before

        return count

    def count_on_gpu(run) -> int:
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA
                   and ("multi_tensor_kernel" in e.name or "add_sum_of_squares_kernel" in e.name))

    return count_on_gpu


@pytest.fixture(autouse=True)
def no_user_device_files(monkeypatch):
    """The planner's catalog reads $HETCOMM_DEVICES; tests see the built-in tables only."""
    monkeypatch.delenv("HETCOMM_DEVICES", raising=False)


@pytest.fixture(scope="module")
def catalog():
    """The planner's built-in GPU and link database."""
    from hetcomm.plan import load_catalog

    return load_catalog()


def gpt_parameter_shapes(n_layer: int = 12, d_model: int = 64, vocab: int = 512, block: int = 128):
    """Shapes of a small GPT's parameters, in module order (~150 tensors)."""
    shapes = [(vocab, d_model), (block, d_model)]
    for _ in range(n_layer):
        shapes += [(d_model,), (d_model,),                        # ln_1
                   (3 * d_model, d_model), (3 * d_model,),        # attention qkv
                   (d_model, d_model), (d_model,),                # attention projection
                   (d_model,), (d_model,),                        # ln_2
                   (4 * d_model, d_model), (4 * d_model,),        # mlp up
                   (d_model, 4 * d_model), (d_model,)]            # mlp down
    return shapes + [(d_model,), (d_model,)]                      # ln_f


def make_tensors(shapes, dtype, device, seed=0, misaligned=False):
    """Random tensors of the given shapes. misaligned=True returns views that start one
    element into their storage, so no vector load is aligned."""
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for shape in shapes:
        numel = 1
        for s in shape:
            numel *= s
        offset = int(misaligned)
        base = (torch.randn(numel + offset, generator=generator) * 4).to(dtype=dtype, device=device)
        tensors.append(base[offset:].view(shape))
    return tensors


def scalar(value: float, device="cpu") -> torch.Tensor:
    return torch.full((1,), value, dtype=torch.float32, device=device)


_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-for-bit equality; NaNs must be NaN in the same places (their payloads may
    legitimately differ between conversion instructions)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    actual, expected = actual.cpu(), expected.cpu()
    nan_actual, nan_expected = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(nan_actual, nan_expected), "NaNs in different places"
    keep = ~nan_actual
    a_bits = actual.view(_INT_VIEW[actual.dtype])[keep]
    e_bits = expected.view(_INT_VIEW[expected.dtype])[keep]
    mismatches = (a_bits != e_bits).nonzero()
    assert mismatches.numel() == 0, (
        f"{mismatches.numel()} elements differ; first at {mismatches[0].item()}: "
        f"{actual[keep][mismatches[0]].item()} vs {expected[keep][mismatches[0]].item()}")


def special_values(dtype) -> torch.Tensor:
    """Values that exercise rounding and non-finite handling: ties, subnormals of
    each format, the largest finite values, and overflows after a cast."""
    values = [0.0, -0.0, 1.0, -1.0, 1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8,
              65504.0, 65520.0, 70000.0, -70000.0, 6e-8, 3e-8, 1e-40, 3.0e38, -3.0e38,
              float(torch.finfo(torch.bfloat16).max), 2**-126, 2**-149]
    return torch.tensor(values, dtype=torch.float32).to(dtype)


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def import_benchmark(name: str):
    """benchmarks/<name>.py as a module: the folder is on the path while it loads, for
    its imports of its neighbours (result_files)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


def torch_unscale_(tensors, found_inf, inv_scale) -> None:
    """torch._amp_foreach_non_finite_check_and_unscale_, the comparison the unscale tests
    make, or where this torch lacks it for the dtype on the device (bf16 on CUDA in torch
    2.11, seen on the H200) hetcomm.reference.unscale_, the tests' own oracle."""
    from hetcomm import reference

    try:
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv_scale)
    except NotImplementedError:
        reference.unscale_(tensors, inv_scale, found_inf)


# Modules whose module-scoped fixtures start ranks or training runs. make test runs
# pytest-xdist with --dist loadgroup, and these modules' tests go to one worker each:
# spread over both, each worker would run the same fixture again (two_nodes' straight
# runs took twice their time that way).
SHARED_RUNS = {"test_two_nodes", "test_faults", "test_integration_lightning", "test_integration_transformers",
               "test_shard", "test_reducer", "test_reducer_expected", "test_ddp_hook"}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__ if item.module is not None else ""
        if module in SHARED_RUNS:
            item.add_marker(pytest.mark.xdist_group(module))
    if getattr(config.option, "loadgroup", False):   # a pytest-xdist worker under --dist loadgroup
        for item in items:
            group_by_nodeid(item)


def group_by_nodeid(item) -> None:
    """What pytest-xdist's worker does for --dist loadgroup, done again after the marks
    above: the nodeid of a test marked xdist_group(name) ends in "@name", which its
    scheduler groups by. xdist's own hook runs before this conftest's, so it missed the
    marks added here; and xdist 3.8 sets item._nodeid, which pytest 9.2 no longer reads
    (its nodeid is str(item._id)), so it missed every mark there: each group's tests were
    dealt to both workers, and both ran the module's fixtures."""
    names = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                    for mark in item.iter_markers("xdist_group")})
    if not names or item.nodeid.endswith("@" + "_".join(names)):
        return
    nodeid = f"{item.nodeid}@{'_'.join(names)}"
    try:
        from _pytest.nodeid import NodeId   # pytest >= 9.2
    except ImportError:
        item._nodeid = nodeid
    else:
        item._id = NodeId.parse(nodeid)
    assert item.nodeid == nodeid, f"could not group {item.nodeid} for pytest-xdist"
