"""adamw_: the fused AdamW step of fp32 masters, bit-exact with hetcomm.reference.adamw_
(one fp32 rounding per operation) on every back end that has it (the CPU kernel, the
CUDA kernel on a GPU and on the emulated sm_61/75/80 GPUs), and torch.optim.AdamW's
update within both sides' fp32 roundings (tolerances.AdamWDrift). test_build reruns the
cpu cases on the scalar loops."""

import pytest
import torch
from conftest import FLOAT_DTYPES, NATIVE_DEVICES, ODD_SIZES, assert_same_bits, make_tensors, scalar
from tolerances import AdamWDrift, excess

import hetcomm
from hetcomm import reference

HYPER = {"lr": 3e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}


def moments(params, seed=1):
    """A state some steps in: exp_avg of either sign, exp_avg_sq positive."""
    avg = make_tensors([p.shape for p in params], torch.float32, params[0].device, seed=seed)
    sq = [t.abs() * 1e-3 for t in make_tensors([p.shape for p in params], torch.float32, params[0].device,
                                                seed=seed + 1)]
    return avg, sq


def run_both(grads, params, avg, sq, copies, found_inf=0.0, step=7.0, grad_scale=0.25, hyper=HYPER):
    """The op and the reference on copies of the same inputs; returns both outcomes."""
    outcomes = []
    device = params[0].device
    scale, flag, count = scalar(grad_scale, device), scalar(found_inf, device), scalar(step, device)
    for run in (hetcomm.adamw_, None):
        p, a, s = [t.clone() for t in params], [t.clone() for t in avg], [t.clone() for t in sq]
        c = [t.clone() for t in copies]
        if run is None:
            reference.adamw_(grads, p, a, s, c, scale, flag, count, **hyper)
        else:
            run(grads, p, a, s, c, grad_scale=scale, found_inf=flag, step=count, **hyper)
        outcomes.append(p + a + s + c)
    return outcomes


def assert_kernel_is_reference(shapes, grad_dtype, copy_dtype, device):
    params = make_tensors(shapes, torch.float32, device)
    grads = make_tensors(shapes, grad_dtype, device, seed=3)
    copies = [] if copy_dtype is None else [torch.empty(s, dtype=copy_dtype, device=device) for s in shapes]
    fused, expected = run_both(grads, params, *moments(params), copies)
    for got, want in zip(fused, expected, strict=True):
        assert_same_bits(got, want)


@pytest.mark.parametrize("copy_dtype", [None, *FLOAT_DTYPES])
@pytest.mark.parametrize("grad_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("size", ODD_SIZES)
def test_the_cpu_loops_are_the_reference_bit_for_bit_at_their_edges_cpu(size, grad_dtype, copy_dtype):
    """Sizes around the 8-wide vector step and across the 32K-element work chunks."""
    assert_kernel_is_reference([(size,), (0,), (size, 3), (5,)], grad_dtype, copy_dtype, "cpu")


@pytest.mark.parametrize("device", NATIVE_DEVICES, indirect=True)
@pytest.mark.parametrize("copy_dtype", [None, *FLOAT_DTYPES])
@pytest.mark.parametrize("grad_dtype", FLOAT_DTYPES)
def test_adamw_is_its_reference_bit_for_bit(device, grad_dtype, copy_dtype):
    """Across the CUDA kernel's 8192-element chunks, an empty tensor, odd sizes."""
    assert_kernel_is_reference([(9,), (0,), (8197,), (5, 3)], grad_dtype, copy_dtype, device)


@pytest.mark.parametrize("device", ["emu-sm61-shuffled"], indirect=True)
def test_a_tensor_longer_than_one_segment(device):
    """The emulated sm_61 cuts tensors into segments of 2^20 elements (as real builds do
    at 2^30): a tensor of 2^20 + 5 is two table entries."""
    assert_kernel_is_reference([(2**20 + 5,), (3,)], torch.float16, torch.bfloat16, device)


@pytest.mark.parametrize("device", NATIVE_DEVICES, indirect=True)
@pytest.mark.parametrize("misaligned", [False, True])
def test_flat_gradient_and_copy_buffers_are_read_and_written_in_list_order(device, misaligned):
    shapes = [(9, 7), (1,), (33,), (4, 4)]
    params = make_tensors(shapes, torch.float32, device, misaligned=misaligned)
    grads = make_tensors(shapes, torch.float16, device, seed=3)
    avg, sq = moments(params)
    _, expected = run_both(grads, params, avg, sq,
                           [torch.empty(s, dtype=torch.bfloat16, device=device) for s in shapes])
    total = sum(p.numel() for p in params)
    # The copy into a view at an offset of a larger buffer: where a shard's copies land
    # in an all-gather buffer.
    gather = torch.full((total + 10,), -7.0, dtype=torch.bfloat16, device=device)
    hetcomm.adamw_([torch.cat([g.flatten() for g in grads])], params, avg, sq, [gather[3:3 + total]],
                   grad_scale=scalar(0.25, device), step=scalar(7.0, device), **HYPER)
    for got, want in zip(params + avg + sq, expected[:3 * len(shapes)], strict=True):
        assert_same_bits(got, want)
    assert_same_bits(gather[3:3 + total], torch.cat([c.flatten() for c in expected[3 * len(shapes):]]))
    assert (gather[:3] == -7).all() and (gather[3 + total:] == -7).all()   # nothing written outside the view


@pytest.mark.parametrize("device", NATIVE_DEVICES, indirect=True)
def test_an_overflow_writes_nothing(device):
    params = make_tensors([(100,), (3, 3)], torch.float32, device)
    grads = [g.half() for g in make_tensors([(100,), (3, 3)], torch.float32, device, seed=3)]
    grads[0][5] = float("inf")
    avg, sq = moments(params)
    copies = [torch.zeros(s, dtype=torch.float16, device=device) for s in ((100,), (3, 3))]
    before = [t.clone() for t in params + avg + sq + copies]
    hetcomm.adamw_(grads, params, avg, sq, copies, found_inf=scalar(1.0, device), step=scalar(3.0, device),
                   **HYPER)
    for got, want in zip(params + avg + sq + copies, before, strict=True):
        assert_same_bits(got, want)


def torch_state(optimizer, p):
    state = optimizer.state[p]
    return state.get("exp_avg"), state.get("exp_avg_sq")


def fifty_steps(decays, lr=1e-2):
    """hetcomm.adamw_ and torch.optim.AdamW(foreach=False) fed the same 50 gradients, from
    zero moments, with weight decay decays[k] on parameter k: both sides' parameters and
    moments, and the AdamWDrift bound on how far they may be apart (from torch's state
    before each step, at the decays torch uses, 0.1 and 0)."""
    shapes = [(64, 32), (32,), (5, 7)]
    params = make_tensors(shapes, torch.float32, "cpu")
    mine = [p.clone() for p in params]
    avg, sq = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    theirs = [torch.nn.Parameter(p.clone()) for p in params]
    torch_decays = (0.1, 0.1, 0.0)
    torch_adamw = torch.optim.AdamW([{"params": theirs[:2], "weight_decay": 0.1},
                                     {"params": theirs[2:], "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95),
                                    eps=1e-8, foreach=False)
    drift = AdamWDrift(params)
    generator = torch.Generator().manual_seed(5)
    for step in range(1, 51):
        grads = [torch.randn(s, generator=generator) for s in shapes]
        for k, (p, g) in enumerate(zip(theirs, grads)):
            p.grad = g.clone()
            drift.step(k, p, *torch_state(torch_adamw, p), g, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8,
                       weight_decay=torch_decays[k], step=step)
        torch_adamw.step()
        for k, decay in enumerate(decays):
            hetcomm.adamw_(grads[k:k + 1], mine[k:k + 1], avg[k:k + 1], sq[k:k + 1], step=scalar(float(step)),
                           lr=lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=decay)
    return (mine, avg, sq), ([p.detach() for p in theirs], *zip(*(torch_state(torch_adamw, p) for p in theirs))), drift


def test_adamw_is_torch_adamw_within_fp32_rounding_cpu():
    """torch.optim.AdamW(foreach=False), 50 steps from zero moments, groups with and
    without weight decay: the same update, within both sides' roundings carried through
    the steps (tolerances.AdamWDrift)."""
    (params, avg, sq), (their_params, their_avg, their_sq), drift = fifty_steps((0.1, 0.1, 0.0))
    for k in range(3):
        assert excess(params[k], their_params[k], drift.param[k]) <= 1
        assert excess(avg[k], their_avg[k], drift.exp_avg[k]) <= 1
        assert excess(sq[k], their_sq[k], drift.exp_avg_sq[k]) <= 1


def test_the_bound_on_torch_adamw_separates_a_wrong_step_cpu():
    """A learning rate a thousandth off, or weight decay on the group without it, lands
    outside the bound."""
    (params, _, _), (their_params, _, _), drift = fifty_steps((0.1, 0.1, 0.0), lr=1e-2 * (1 + 1e-3))
    assert max(excess(params[k], their_params[k], drift.param[k]) for k in range(3)) > 10
    (params, _, _), (their_params, _, _), drift = fifty_steps((0.1, 0.1, 0.1))
    assert excess(params[2], their_params[2], drift.param[2]) > 10


@pytest.mark.parametrize("device", NATIVE_DEVICES, indirect=True)
def test_adamw_opcheck(device):
    params = make_tensors([(3, 5), (769,)], torch.float32, device)
    grads = make_tensors([(3, 5), (769,)], torch.bfloat16, device, seed=2)
    avg, sq = moments(params)
    copies = [torch.empty_like(p, dtype=torch.float16) for p in params]
    torch.library.opcheck(torch.ops.hetcomm.adamw_.default,
                          (grads, params, avg, sq, copies, scalar(0.5, device), scalar(0.0, device),
                           scalar(2.0, device), 1e-3, 0.9, 0.999, 1e-8, 0.01))


def bad_calls():
    """(name, call arguments changed from a good call, the error's type, its message)."""
    p = [torch.randn(4), torch.randn(2, 3)]
    good = {"grads": [torch.randn(4).half(), torch.randn(2, 3).half()], "params": p,
            "exp_avgs": [torch.zeros(4), torch.zeros(2, 3)], "exp_avg_sqs": [torch.zeros(4), torch.zeros(2, 3)],
            "copies": [], "grad_scale": scalar(1.0), "found_inf": scalar(0.0), "step": scalar(1.0), **HYPER}
    shared = torch.zeros(10)
    return good, [
        ("no params", {"params": []}, RuntimeError, "params is an empty list; expected at least one tensor"),
        ("fp16 master", {"params": [p[0].half(), p[1]]}, TypeError,
         "params[0] has dtype torch.float16; expected torch.float32 (the fp32 master weights)"),
        ("non-contiguous master", {"params": [p[0], torch.randn(3, 2).t()]}, RuntimeError,
         "params[1] is not contiguous"),
        ("a moment short", {"exp_avgs": [torch.zeros(4)]}, RuntimeError,
         "exp_avgs has 1 tensors but params has 2; expected one per parameter"),
        ("a moment of another size", {"exp_avg_sqs": [torch.zeros(4), torch.zeros(5)]}, RuntimeError,
         "exp_avg_sqs[1] has 5 elements but params[1] has 6; expected as many"),
        ("an fp16 moment", {"exp_avgs": [torch.zeros(4).half(), torch.zeros(2, 3)]}, TypeError,
         "exp_avgs[0] has dtype torch.float16; expected torch.float32"),
        ("three grads", {"grads": [torch.randn(4)] * 3}, RuntimeError,
         "grads has 3 tensors; expected one per parameter (2) or one flat 1-D buffer of their 10 elements"),
        ("a flat gradient too short", {"grads": [torch.randn(9)]}, RuntimeError,
         "grads[0], a flat buffer, has 9 elements but params hold 10 in all; expected exactly that many"),
        ("an int gradient", {"grads": [torch.ones(4, dtype=torch.int32), torch.randn(2, 3)]}, TypeError,
         "grads[0] has dtype torch.int32; expected torch.float32, torch.float16 or torch.bfloat16"),
        ("a gradient on another device", {"grads": [torch.randn(4, device="meta"), torch.randn(2, 3)]},
         RuntimeError, "grads[0] is on meta but the other tensors are on cpu"),
        ("a copy of another size", {"copies": [torch.zeros(4).half(), torch.zeros(7).half()]}, RuntimeError,
         "copies[1] has 7 elements but params[1] has 6; expected as many"),
        ("a copy over its master", {"copies": [p[0], torch.zeros(6).half()]}, RuntimeError,
         "params[0] and copies[0] share memory"),
        ("moments in one buffer", {"exp_avgs": [shared[:4], shared[3:9].view(2, 3)]}, RuntimeError,
         "exp_avgs[0] and exp_avgs[1] share memory"),
        ("a 2-element step", {"step": torch.ones(2)}, RuntimeError,
         "step must be a 1-element torch.float32 tensor; got shape [2]"),
        ("a negative lr", {"lr": -1e-3}, RuntimeError, "lr = -0.001; expected a finite number >= 0"),
        ("a NaN lr", {"lr": float("nan")}, RuntimeError, "lr = nan; expected a finite number >= 0"),
        ("beta1 of 1", {"beta1": 1.0}, RuntimeError, "beta1 = 1; expected 0 <= beta1 < 1"),
        ("a NaN beta2", {"beta2": float("nan")}, RuntimeError, "beta2 = nan; expected 0 <= beta2 < 1"),
        ("an infinite eps", {"eps": float("inf")}, RuntimeError, "eps = inf; expected a finite number >= 0"),
        ("a negative weight decay", {"weight_decay": -0.1}, RuntimeError,
         "weight_decay = -0.1; expected a finite number >= 0"),
    ]


@pytest.mark.parametrize("case", range(len(bad_calls()[1])), ids=[c[0] for c in bad_calls()[1]])
def test_a_bad_call_names_the_argument_and_writes_nothing_cpu(case):
    good, cases = bad_calls()
    _, changes, error, message = cases[case]
    arguments = {**good, **changes}
    written = [t for name in ("params", "exp_avgs", "exp_avg_sqs", "copies") for t in arguments[name]
               if t.device.type == "cpu"]
    before = [t.clone() for t in written]
    ordered = [arguments[name] for name in ("grads", "params", "exp_avgs", "exp_avg_sqs", "copies", "grad_scale",
                                            "found_inf", "step", "lr", "beta1", "beta2", "eps", "weight_decay")]
    with pytest.raises(error, match=f"hetcomm.adamw_: {message}".replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)").replace(".", r"\.")):
        torch.ops.hetcomm.adamw_.default(*ordered)
    for got, want in zip(written, before, strict=True):
        assert_same_bits(got, want)
