"""`hetcomm demo`: one weighted gradient reduction step of a heterogeneous cluster,
simulated in one process, checked against float64 and timed against the unfused route.

Four ranks of different speeds processed different numbers of samples (3, 7, 1, 13 by
default). Each rank packs its GPT-shaped gradients onto a 16-bit wire with its weight
n_i/N and the loss scale fused in; the wires are summed (in one process this stands in
for the all-reduce); the sum is unpacked with the unscale, the overflow check and the
squared norm fused in. The result must equal the gradient of the mean loss over all N
samples, sum_i (n_i/N) g_i, within the wire's rounding.
"""

import argparse
import time

import torch

from hetcomm import ops


def gpt_gradient_shapes(n_layer: int, d_model: int, vocab: int = 50304, block: int = 1024):
    shapes = [(vocab, d_model), (block, d_model)]
    for _ in range(n_layer):
        shapes += [(d_model,), (d_model,), (3 * d_model, d_model), (3 * d_model,), (d_model, d_model),
                   (d_model,), (d_model,), (d_model,), (4 * d_model, d_model), (4 * d_model,),
                   (d_model, 4 * d_model), (d_model,)]
    return shapes + [(d_model,), (d_model,)]


def median_seconds(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hetcomm demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, nargs="+", default=[3, 7, 1, 13],
                        help="samples processed by each simulated rank (default: 3 7 1 13)")
    parser.add_argument("--layers", type=int, default=4, help="GPT layers (default 4)")
    parser.add_argument("--d-model", type=int, default=256, help="GPT width (default 256)")
    parser.add_argument("--wire", choices=["float16", "bfloat16", "float32"], default="float16")
    parser.add_argument("--loss-scale", type=float, default=2.0**12)
    args = parser.parse_args(argv)
    if any(n < 0 for n in args.samples) or sum(args.samples) == 0:
        parser.error("--samples must be non-negative counts with a positive sum")
    wire_dtype = getattr(torch, args.wire)

    shapes = gpt_gradient_shapes(args.layers, args.d_model)
    total = sum(torch.Size(s).numel() for s in shapes)
    counts = args.samples
    global_batch = sum(counts)
    print(f"hetcomm demo: {len(counts)} simulated ranks in one process (the all-reduce is a local sum), "
          f"{len(shapes)} gradient tensors, {total / 1e6:.1f}M elements, {args.wire} wire, "
          f"loss scale {args.loss_scale:g}")
    print(f"samples per rank {counts} -> weights {[round(n / global_batch, 4) for n in counts]}")

    generator = torch.Generator().manual_seed(0)
    rank_grads = [[torch.randn(s, generator=generator) * 1e-3 for s in shapes] for _ in counts]
    scales = [torch.tensor([args.loss_scale * n / global_batch]) for n in counts]

    wire_sum = torch.zeros(total, dtype=wire_dtype)
    wire = torch.empty(total, dtype=wire_dtype)
    for grads, scale in zip(rank_grads, scales):
        ops.pack(grads, scale, out=wire)
        wire_sum += wire
    reduced = [torch.empty(s) for s in shapes]
    found_inf, sq_norm = torch.zeros(1), torch.zeros(1)
    ops.unpack_(wire_sum, reduced, 1.0 / args.loss_scale, found_inf, sq_norm)

    exact = [sum((n / global_batch) * g[k].double() for n, g in zip(counts, rank_grads))
             for k in range(len(shapes))]
    exact_flat = torch.cat([e.reshape(-1) for e in exact])
    got_flat = torch.cat([r.reshape(-1) for r in reduced]).double()
    relative_error = ((got_flat - exact_flat).norm() / exact_flat.norm()).item()
    exact_norm = exact_flat.norm().item()
    unit_roundoff = torch.finfo(wire_dtype).eps / 2
    print(f"found_inf {found_inf.item():.0f}, grad norm {sq_norm.sqrt().item():.6f} (float64: {exact_norm:.6f}), "
          f"relative error of the reduced gradient {relative_error:.2e} "
          f"(wire unit roundoff {unit_roundoff:.1e}, {len(counts)} additions)")
    ok = found_inf.item() == 0 and relative_error < 4 * len(counts) * unit_roundoff

    grads, scale = rank_grads[0], scales[0]
    inv_scale = torch.tensor([1.0 / args.loss_scale])
    flat32 = torch.empty(total)
    sizes = [g.numel() for g in grads]

    def fused():
        ops.pack(grads, scale, out=wire)
        ops.unpack_(wire, reduced, inv_scale, found_inf, sq_norm)

    def unfused():
        torch.cat([g.reshape(-1) for g in grads], out=flat32)
        flat32.mul_(scale)
        wire.copy_(flat32)
        torch._foreach_copy_(reduced, [v.view(s) for v, s in zip(wire.split(sizes), shapes)])
        torch._amp_foreach_non_finite_check_and_unscale_(reduced, found_inf, inv_scale)
        sq_norm.copy_(torch.stack(torch._foreach_norm(reduced)).square().sum())

    t_fused, t_unfused = median_seconds(fused), median_seconds(unfused)
    print(f"pack + unpack_ per rank on this CPU ({torch.get_num_threads()} threads): fused {t_fused * 1e3:.1f} ms, "
          f"unfused PyTorch {t_unfused * 1e3:.1f} ms ({t_unfused / t_fused:.1f}x)")
    print("result: " + ("OK, equals the float64 weighted mean gradient within the wire's rounding" if ok
                        else "MISMATCH"))
    return 0 if ok else 1
