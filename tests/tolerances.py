"""Tolerances derived from the computation, not fitted to one host's rounding.

Two kinds, and each test says which it uses:

- A single reduction (a sum, a norm, a dot product) against its float64 value: the
  classical bound. Summing n terms in any order in a format of unit roundoff u errs by
  at most gamma(n - 1) = (n - 1) u / (1 - (n - 1) u) times the sum of the terms'
  magnitudes (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., 4.2),
  whatever the order, the blocking or the vector width a CPU's kernels pick.

- Whole training runs (forwards, backwards through a model, clipping, several optimizer
  steps) against a one-process reference: no closed-form bound is useful there, since
  AdamW divides each gradient element by its own running magnitude, so that the
  rounding of a small element becomes a sizeable part of a step. What the run under test
  may differ by is what the *reference itself* differs by when only the order of its
  sums changes, which this host's kernels decide: order_bound measures that (the same
  reference run on the global batch in other orders) and allows SPREAD_FACTOR times it.
  Measured ratios of the distributed runs' distance to this spread: 0.2 to 2.2 over
  ATen's default, AVX2 and AVX-512 kernels on an AMD EPYC host for GPT-2, but 7 for the
  tiny BERT under ATen's default kernels in CI, whose reordered twins happened to land
  close to the reference: the run under test reorders sums in more places than one
  reordered reference does (each rank's partial sums, the weighting on the wire, the
  all-reduce), hence a factor of 8. A weighting that is wrong lands orders of magnitude
  further (the tests show it does)."""

import torch

UNIT_ROUNDOFF = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11,
                 torch.bfloat16: 2.0 ** -8}
SPREAD_FACTOR = 8
# A global batch's samples in other orders, for a reference run's reordered twins: the same
# sums in other orders.
REORDERINGS = (lambda indices: indices[::-1], lambda indices: indices[len(indices) // 2:] + indices[:len(indices) // 2])
# Where the reordered references happen to agree bit for bit, a few units in the last place
# of the largest value still separate two honest runs.
ULPS_FLOOR = 4


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Higham's gamma_n: the relative error bound of n roundings in a row."""
    nu = n * UNIT_ROUNDOFF[dtype]
    assert nu < 1, f"{n} roundings of {dtype} bound nothing"
    return nu / (1 - nu)


def sum_rtol(n: int, dtype: torch.dtype = torch.float32) -> float:
    """The relative error bound of a sum of n non-negative terms in `dtype`, in any order
    (a sum of squares: a norm's square)."""
    return gamma(max(n - 1, 1), dtype)


def farthest(a, b) -> float:
    """The largest elementwise distance between two lists of tensors (or of numbers)."""
    return max((torch.as_tensor(x, dtype=torch.float64) - torch.as_tensor(y, dtype=torch.float64)).abs().max().item()
               for x, y in zip(a, b))


def order_bound(reference, reordered) -> float:
    """The distance a run of the same computation as `reference` may land from it: the
    farthest that `reordered` (the reference's computation with its sums in other orders)
    land from it, times SPREAD_FACTOR, plus ULPS_FLOOR units in the last place of the
    reference's largest value."""
    spread = max(farthest(r, reference) for r in reordered)
    largest = max(torch.as_tensor(x).abs().max().item() for x in reference)
    dtype = torch.as_tensor(reference[0]).dtype
    return SPREAD_FACTOR * spread + ULPS_FLOOR * UNIT_ROUNDOFF.get(dtype, UNIT_ROUNDOFF[torch.float32]) * 2 * largest


# --- Single computations, counted operation by operation ------------------------------
#
# Each bound below is a count of the roundings on the way from the inputs to a result,
# turned into a relative error by compose(); where a result is a sum, relative to the sum
# of its terms' magnitudes (Higham 2.2 and 3.1). All hold whatever order a host's kernels
# add in, since only the number of roundings on a term's way is counted, never where.

def compose(*errors: float) -> float:
    """The relative error of a chain of steps, each within its own relative error."""
    total = 1.0
    for error in errors:
        total *= 1 + error
    return total - 1


def apart(tested: float, reference: float) -> float:
    """The rtol, relative to the reference's value, by which two approximations of one
    exact value may differ when they are within `tested` and `reference` of it."""
    return (tested + reference) / (1 - reference)


def sq_norm_rtol(n: int, fp32_terms: int = 0, additions: int = 1) -> float:
    """unpack_'s sq_norm of n written values against their exact sum of squares: squares
    summed in fp32 in runs of up to `fp32_terms` before float64 takes over (0: squared
    and summed in float64 from the start, as the CPU kernels and the reference do; 8: the
    CUDA kernels' fused multiply-adds per vector group; BLOCK: a Triton program's
    block), at most n float64 additions, one rounding to fp32, and `additions` fp32
    additions into sq_norm (one per unpack_ call)."""
    fp32_run = gamma(fp32_terms) if fp32_terms else 0.0
    return compose(fp32_run, gamma(n, torch.float64), UNIT_ROUNDOFF[torch.float32],
                   gamma(additions) if additions else 0.0)


def sqrt_rtol(squared_rtol: float) -> float:
    """The relative error of an fp32 square root of a value within `squared_rtol`: half
    of it, to first order, and the root's own rounding, counted as one ulp (two
    roundings: torch's fp32 sqrt on CPU is not always correctly rounded)."""
    return compose(1 - (1 - squared_rtol) ** 0.5, 2 * UNIT_ROUNDOFF[torch.float32])


def subnormal_step(dtype: torch.dtype) -> float:
    """The absolute error of one rounding to `dtype` below its normal range (half the
    spacing of its subnormals), where a relative bound says nothing."""
    info = torch.finfo(dtype)
    return info.tiny * info.eps / 2


def reduction_rtol(ranks: int, wire: torch.dtype, scale_roundings: int = 0) -> float:
    """WeightedReducer's sum_i w_i g_i, per element, relative to sum_i |w_i g_i|: each
    rank's weight rounded from a double to fp32, the product g_i * w_i rounded in fp32,
    cast to the wire, ranks - 1 additions on the wire (each, on a 16-bit wire, an fp32
    sum rounded to the wire: two roundings), unpack_'s multiply by its scale, that scale
    made by `scale_roundings` fp32 roundings of double values (a loss scale's reciprocal,
    an expected total's correction), and the test's float64 sum."""
    u32, u64, u_wire = (UNIT_ROUNDOFF[t] for t in (torch.float32, torch.float64, wire))
    to_fp32 = compose(u64, u32)
    addition = u32 if wire == torch.float32 else compose(u32, u_wire)
    wire_cast = 0.0 if wire == torch.float32 else u_wire
    return compose(to_fp32, u32, wire_cast, *[addition] * (ranks - 1), u32, *[to_fp32] * scale_roundings,
                   gamma(ranks + 1, torch.float64))


def reduction_floor(ranks: int, wire: torch.dtype, unpack_scale: float, rtol: float) -> float:
    """The absolute part of the same bound: each rounding on the wire (a cast per rank,
    ranks - 1 additions) may land below the wire's normal range, where it errs by up to
    subnormal_step(wire) in wire units; unpack_ multiplies by unpack_scale."""
    return (2 * ranks - 1) * subnormal_step(wire) * abs(unpack_scale) * (1 + rtol)


def weighted_sum(terms, weights):
    """sum_i w_i t_i and sum_i |w_i t_i| in float64; a term None contributes nothing."""
    expected = magnitude = 0.0
    for term, weight in zip(terms, weights, strict=True):
        if term is not None:
            weighted = term.double() * weight
            expected, magnitude = expected + weighted, magnitude + weighted.abs()
    return expected, magnitude


def excess(got, expected, allowance) -> float:
    """The largest |got - expected| / allowance over the elements (<= 1: within it)."""
    distance = (got.double() - expected).abs()
    allowance = torch.as_tensor(allowance, dtype=torch.float64).expand_as(distance)
    ratio = torch.where(distance == 0, 0.0, distance / allowance)
    return ratio.max().item() if ratio.numel() else 0.0


def fp32_squares_run(backend: str, device: str = "cpu") -> int:
    """How many squares unpack_ on `backend` (a `device` parametrization of the op tests:
    "cpu", "cuda", "emu-...", "triton") sums in fp32 before float64: sq_norm_rtol's
    fp32_terms. The CUDA kernels fuse at most one 16-byte group (8 values) per fp32 run;
    a Triton program sums one block, in an order tl.sum does not promise."""
    if backend == "cpu":
        return 0
    if backend == "triton":
        from hetcomm.triton import configs

        return configs.default_config(torch.device(device)).kwargs["BLOCK"]
    return 8


def weighted_excess(got, terms, weights, rtol: float, floor: float = 0.0) -> float:
    """excess() of `got` over sum_i w_i t_i with rtol times sum_i |w_i t_i| plus floor."""
    expected, magnitude = weighted_sum(terms, weights)
    return excess(got, expected, rtol * magnitude + floor)


class AdamWDrift:
    """How far two fp32 AdamW implementations fed the same gradients may drift apart,
    per element, step after step: a running error bound (Higham 3.3), to first order.

    Per step and side, the roundings on each path, counted from hetcomm.reference.adamw_
    and torch's single-tensor AdamW (its fused step counts no more):
      exp_avg     m + (g - m)(1 - b1): the gradient's scaling, the difference, the
                  constant, the product, the sum: 5, relative to |m| + (1 - b1)(|g| + |m|).
      exp_avg_sq  v b2 + g g (1 - b2): the scaling (twice, squared), the square, the
                  constant, the product, the sum: 6, relative to the new v (no term is
                  negative).
      param       p (1 - lr wd): the constant, the product, the sum: 3, relative to its
                  value; the step T = -lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps): the root
                  (one ulp, 2), the constant and the division, eps and the sum, the
                  division, the constant, the product, the sum: 10, relative to |T|.
    What the two sides already differ by carries on: the moments' by b1 and b2, the
    parameter's by 1 - lr wd, and into T through its derivatives in m and v. Magnitudes
    are taken from the side whose state is given (the other is within the bound of it)."""

    ROUNDINGS = {"exp_avg": 5, "exp_avg_sq": 6, "decayed": 3, "step": 10}

    def __init__(self, params):
        self.param = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
        self.exp_avg = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
        self.exp_avg_sq = [torch.zeros(p.shape, dtype=torch.float64) for p in params]

    def step(self, index, param, exp_avg, exp_avg_sq, grad, *, lr, beta1, beta2, eps, weight_decay, step):
        """Accounts for the step `step` (1 for the first) of parameter `index`, given its
        param, moments (None before the first step) and gradient before the step."""
        pair = {name: gamma(2 * count) for name, count in self.ROUNDINGS.items()}
        p, g = param.detach().double().cpu(), grad.double().cpu()
        m = torch.zeros_like(p) if exp_avg is None else exp_avg.double().cpu()
        v = torch.zeros_like(p) if exp_avg_sq is None else exp_avg_sq.double().cpu()
        new_m, new_v = beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * g * g
        self.exp_avg[index] = beta1 * self.exp_avg[index] + pair["exp_avg"] * (m.abs() + (1 - beta1) * (
            g.abs() + m.abs()))
        self.exp_avg_sq[index] = beta2 * self.exp_avg_sq[index] + pair["exp_avg_sq"] * new_v
        root = new_v.sqrt() / (1 - beta2 ** step) ** 0.5
        denom = root + eps
        step_size = lr / (1 - beta1 ** step)
        update = (step_size * new_m / denom).abs()
        by_m = step_size / denom
        by_v = torch.where(new_v > 0, update * root / (2 * new_v.clamp_min(torch.finfo(torch.float64).tiny) * denom),
                           0.0)
        decay = 1 - lr * weight_decay
        self.param[index] = (decay * self.param[index] + pair["decayed"] * (decay * p).abs() + pair["step"] * update
                             + by_m * self.exp_avg[index] + by_v * self.exp_avg_sq[index])
