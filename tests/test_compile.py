"""The ops trace into one graph under torch.compile and give the eager results."""

import torch
from conftest import gpt_parameter_shapes, make_tensors, scalar

import hetcomm


def reduce_step(grads, scale, inv_scale, found_inf, sq_norm):
    flat = hetcomm.pack(grads, scale, torch.float16)
    hetcomm.unpack_(flat, grads, inv_scale, found_inf, sq_norm)
    hetcomm.unscale_(grads, inv_scale, found_inf)


def run(step, shapes):
    grads = make_tensors(shapes, torch.float32, "cpu", seed=3)
    found_inf, sq_norm = torch.zeros(1), torch.zeros(1)
    step(grads, scalar(1024.0), scalar(1 / 1024), found_inf, sq_norm)
    return grads, found_inf, sq_norm


def test_compiled_fullgraph_matches_eager():
    compiled = torch.compile(reduce_step, fullgraph=True)
    for shapes in (gpt_parameter_shapes(n_layer=2), [(5, 3), (769,)]):
        eager_grads, eager_found, eager_norm = run(reduce_step, shapes)
        compiled_grads, compiled_found, compiled_norm = run(compiled, shapes)
        for got, want in zip(compiled_grads, eager_grads):
            assert torch.equal(got, want)
        assert torch.equal(compiled_found, eager_found) and torch.equal(compiled_norm, eager_norm)
