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
  ATen's default, AVX2 and AVX-512 kernels on an AMD EPYC host; the run under test
  reorders sums in more places than one reordered reference does (each rank's partial
  sums, the weighting on the wire, the all-reduce), hence a factor above 2. A weighting
  that is wrong lands orders of magnitude further (the tests show it does)."""

import torch

UNIT_ROUNDOFF = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11,
                 torch.bfloat16: 2.0 ** -8}
SPREAD_FACTOR = 4
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
