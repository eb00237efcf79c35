"""CPU throughput of the fused ops against the best unfused PyTorch routes and plain
copy bandwidth, measured in the same run. `python benchmarks/report.py` turns the
JSON that pytest-benchmark writes into the README's table of GB/s and ratios.

    pytest benchmarks/bench_ops_cpu.py --benchmark-json=.benchmarks/ops_cpu.json

Effective GB/s counts the bytes an op must move at least (each input element read
once, each output element written once), whatever route is timed.
"""

import pytest
import torch

import hetcomm

ROUNDS = 15


def run(benchmark, fn, op, provider, size_name, work, bytes_moved):
    benchmark.group = f"{op} {size_name}"
    benchmark.extra_info.update(op=op, provider=provider, size=size_name, elements=work.total,
                                bytes=bytes_moved, threads=torch.get_num_threads(), torch=torch.__version__,
                                cpu_isa=hetcomm.info()["backends"]["cpu"]["vector_isa"])
    benchmark.pedantic(fn, rounds=ROUNDS, warmup_rounds=2, iterations=1)


# pack: fp32 gradients x scale -> one fp16 wire buffer (4 bytes read + 2 written per element)
PACK = {
    "hetcomm": lambda w: hetcomm.pack(w.grads, w.scale, out=w.wire16),
    "cat+mul_+copy_": lambda w: (torch.cat(w.grads, out=w.flat32), w.flat32.mul_(w.scale),
                                 w.wire16.copy_(w.flat32)),
    # DDP's fp16 hook order: cast into the wire, then scale in 16 bits.
    "foreach_copy_+mul_": lambda w: (torch._foreach_copy_(list(w.wire16.split(w.sizes)), w.grads),
                                     w.wire16.mul_(w.scale)),
}


# unpack_: fp16 wire x inv_scale -> fp32 gradients, with the overflow flag and squared norm
def unpack_foreach(w):
    views = list(w.wire16.split(w.sizes))
    torch._foreach_copy_(w.grads_out, views)
    torch._amp_foreach_non_finite_check_and_unscale_(w.grads_out, w.found_inf, w.inv_scale)
    w.sq_norm.copy_(torch.stack(torch._foreach_norm(w.grads_out)).square().sum())


def unpack_flat(w):
    w.flat32.copy_(w.wire16)
    w.flat32.mul_(w.inv_scale)
    w.found_inf.copy_(~torch.isfinite(w.flat32).all())
    w.sq_norm.copy_(torch.dot(w.flat32, w.flat32))
    torch._foreach_copy_(w.grads_out, list(w.flat32.split(w.sizes)))


UNPACK = {
    "hetcomm": lambda w: hetcomm.unpack_(w.wire16, w.grads_out, w.inv_scale, w.found_inf, w.sq_norm),
    "foreach_copy_+unscale+norm": unpack_foreach,
    "copy_+mul_+isfinite+dot+foreach_copy_": unpack_flat,
}

# unscale_: fp32 gradients in place (4 read + 4 written)
UNSCALE = {
    "hetcomm": lambda w: hetcomm.unscale_(w.grads_out, w.scale, w.found_inf),
    "torch._amp_foreach_non_finite_check_and_unscale_":
        lambda w: torch._amp_foreach_non_finite_check_and_unscale_(w.grads_out, w.found_inf, w.scale),
}

# cast_: fp32 master weights -> bf16 model weights (4 read + 2 written)
CAST = {
    "hetcomm": lambda w: hetcomm.cast_(w.grads, w.model16),
    "torch._foreach_copy_": lambda w: torch._foreach_copy_(w.model16, w.grads),
}

# adamw_: an AdamW step of fp32 masters from fp16 gradients, writing bf16 copies: per
# element read the gradient (2) and the master and both moments (12), write those (12)
# and the copy (2). torch's best route needs the gradient in fp32 first and the copy after.
ADAMW_HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
ADAMW = {
    "hetcomm": lambda w: hetcomm.adamw_(w.grads16, w.masters, w.exp_avgs, w.exp_avg_sqs, w.model16,
                                        grad_scale=w.scale, found_inf=w.found_inf, step=w.step, **ADAMW_HYPER),
    "foreach_copy_+_fused_adamw_+foreach_copy_": lambda w: (
        torch._foreach_copy_(w.grads_out, w.grads16),
        torch._fused_adamw_(w.masters, w.grads_out, w.exp_avgs, w.exp_avg_sqs, [], w.steps, amsgrad=False,
                            maximize=False, grad_scale=w.inv_scale, found_inf=w.found_inf,
                            **ADAMW_HYPER),
        torch._foreach_copy_(w.model16, w.masters)),
}

CASES = ([("pack", p, f, 6) for p, f in PACK.items()] + [("unpack_", p, f, 6) for p, f in UNPACK.items()] +
         [("unscale_", p, f, 8) for p, f in UNSCALE.items()] + [("cast_", p, f, 6) for p, f in CAST.items()] +
         [("adamw_", p, f, 28) for p, f in ADAMW.items()])


@pytest.mark.parametrize("op, provider, fn, bytes_per_element", CASES,
                         ids=[f"{op}-{provider}" for op, provider, _, _ in CASES])
def bench_op(benchmark, workload, op, provider, fn, bytes_per_element):
    size_name, work = workload
    work.grads_out = [g.clone() for g in work.grads] if op == "unscale_" else work.grads_out
    run(benchmark, lambda: fn(work), op, provider, size_name, work, bytes_per_element * work.total)


def bench_copy_bandwidth(benchmark, workload):
    """The hardware reference: one fp32 tensor copied to another (4 read + 4 written)."""
    size_name, work = workload
    run(benchmark, lambda: work.copy_dst.copy_(work.copy_src), "copy", "torch copy_ fp32", size_name, work,
        8 * work.total)
