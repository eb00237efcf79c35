"""hetcomm.optim.AdamW: torch.optim.AdamW's optimizer on fp32 masters, stepped by the
fused adamw_ op, writing the 16-bit model's weights. Against torch.optim.AdamW
(foreach=False) fed the same gradients, over 200 steps of a small GPT, within both
sides' roundings carried through the steps (tolerances.AdamWDrift)."""

import pytest
import torch
from tolerances import AdamWDrift, excess

from hetcomm.optim import AdamW
from hetcomm.train.model import GPT, GPTConfig

STEPS, SKIPPED = 200, 120


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))


def groups(params):
    """nanoGPT's groups: weight decay on matrices, none on biases and norms."""
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def account(drift, optimizer, params, grad_scale=1.0):
    """Adds the step `optimizer` is about to take to drift (parameter k: params[k]), from
    its state and hyper-parameters before the step."""
    index = {id(p): k for k, p in enumerate(params)}
    for group in optimizer.param_groups:
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            state = optimizer.state[p]
            step = 1 + (int(state["step"]) if "step" in state else 0)
            drift.step(index[id(p)], p, state.get("exp_avg"), state.get("exp_avg_sq"), p.grad * grad_scale,
                       lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                       weight_decay=group["weight_decay"], step=step)


def assert_within_drift(got, want, drift):
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        assert excess(a.detach(), b.detach(), drift.param[k]) <= 1, k


def schedule(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 20) * 0.99 ** step)


@pytest.mark.parametrize("copy_dtype", [torch.float16, torch.bfloat16])
def test_200_steps_of_a_small_gpt_are_torch_adamw_s(copy_dtype):
    """The same gradient each step on both sides (from the torch side's weights, rounded
    through the 16-bit model's dtype), an LR schedule, weight-decay groups, and at step
    SKIPPED an overflow: torch's side does not step, ours is told found_inf."""
    reference_model = tiny_gpt()
    model = tiny_gpt().to(copy_dtype)   # the 16-bit weights the forward would use
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in tiny_gpt().parameters()]
    theirs = torch.optim.AdamW(groups(list(reference_model.parameters())), lr=3e-3, betas=(0.9, 0.95),
                               eps=1e-8, foreach=False)
    ordered = [p for group in groups(masters) for p in group["params"]]
    copy_of = dict(zip(map(id, masters), model.parameters()))
    ours = AdamW(groups(masters), lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
                 copies=[copy_of[id(p)] for p in ordered])
    schedulers = [schedule(theirs), schedule(ours)]
    drift = AdamWDrift(masters)
    generator = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        tokens = torch.randint(0, 64, (4, 17), generator=generator)
        theirs.zero_grad()
        _, loss = reference_model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        for ref, master in zip(reference_model.parameters(), masters):
            ref.grad = ref.grad.to(copy_dtype).float()
            master.grad = ref.grad.clone()
        if step == SKIPPED:
            ours.step(found_inf=torch.ones(1))
        else:
            account(drift, theirs, list(reference_model.parameters()))
            theirs.step()
            ours.step()
        for scheduler in schedulers:
            scheduler.step()
    assert_within_drift(masters, list(reference_model.parameters()), drift)
    for k, (ref, master, copy) in enumerate(zip(reference_model.parameters(), masters, model.parameters())):
        assert excess(ours.state[master]["exp_avg"], theirs.state[ref]["exp_avg"], drift.exp_avg[k]) <= 1
        assert excess(ours.state[master]["exp_avg_sq"], theirs.state[ref]["exp_avg_sq"], drift.exp_avg_sq[k]) <= 1
        assert torch.equal(copy.detach(), master.detach().to(copy_dtype))
    for master in masters:
        assert ours.state[master]["step"].item() == STEPS - 1 == theirs.state[reference_model.wte.weight]["step"]


def trained(optimizer_class, params, steps, generator, state=None, drift=None, **options):
    optimizer = optimizer_class(groups(params), lr=1e-2, betas=(0.9, 0.95), **options)
    if state is not None:
        optimizer.load_state_dict(state)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        if drift is not None:
            account(drift, optimizer, params)
        optimizer.step()
    return optimizer


@pytest.mark.parametrize("first, then", [(torch.optim.AdamW, AdamW), (AdamW, torch.optim.AdamW)],
                         ids=["torch state into hetcomm", "hetcomm state into torch"])
def test_a_state_dict_goes_either_way(first, then):
    """30 steps of one, its state_dict loaded into the other, 30 more: as 60 steps of torch's."""
    start = [p.detach().clone() for p in tiny_gpt().parameters()]
    straight = [torch.nn.Parameter(p.clone()) for p in start]
    drift = AdamWDrift(start)
    trained(torch.optim.AdamW, straight, 60, torch.Generator().manual_seed(3), drift=drift, foreach=False)
    switched = [torch.nn.Parameter(p.clone()) for p in start]
    generator = torch.Generator().manual_seed(3)
    state = trained(first, switched, 30, generator).state_dict()
    trained(then, switched, 30, generator, state=state)
    assert_within_drift(switched, straight, drift)


@pytest.mark.parametrize("options, error, message", [
    ({"lr": float("nan")}, ValueError, "lr = nan; expected a finite float >= 0"),
    ({"betas": (0.9, 1.0)}, ValueError, "betas = (0.9, 1.0); expected two floats in [0, 1)"),
    ({"eps": -1.0}, ValueError, "eps = -1.0; expected a finite float >= 0"),
    ({"weight_decay": float("inf")}, ValueError, "weight_decay = inf; expected a finite float >= 0"),
    ({"copies": [torch.zeros(3)]}, ValueError, "copies has 1 tensors but the groups hold 2 parameters"),
    ({"copies": [torch.zeros(4), torch.zeros(5)]}, ValueError, "copies[0] has 4 elements but its parameter has 3"),
])
def test_bad_arguments_are_named(options, error, message):
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(5))]
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        AdamW(params, **options)


def test_16_bit_parameters_and_amsgrad_are_refused():
    with pytest.raises(TypeError, match="a parameter has dtype torch.float16; expected torch.float32"):
        AdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))])
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        AdamW([{"params": [torch.nn.Parameter(torch.zeros(3))], "amsgrad": True}])


def test_without_a_kernel_for_the_device_the_steps_are_the_same(monkeypatch):
    """Where adamw_ has no kernel (CUDA tensors with a CPU-only build), the optimizer
    steps through torch's _fused_adamw_ and a cast: the same masters within both sides'
    roundings (drift, from the kernel's run), the same copies of them, the same skip."""
    from hetcomm.optim import adamw

    outcomes = []
    drift = AdamWDrift([p.detach() for p in tiny_gpt().parameters()])
    for fused in (True, False):
        monkeypatch.setattr(adamw, "_has_kernel", lambda device, fused=fused: fused)
        params = [torch.nn.Parameter(p.detach().clone()) for p in tiny_gpt().parameters()]
        copies = [torch.empty(p.shape, dtype=torch.bfloat16) for p in params]
        optimizer = AdamW(params, lr=1e-2, copies=copies)
        generator = torch.Generator().manual_seed(4)
        for step in range(20):
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator) * 8
            if fused and step != 5:
                account(drift, optimizer, params, grad_scale=0.125)
            optimizer.step(grad_scale=torch.tensor([0.125]), found_inf=torch.ones(1) if step == 5 else None)
        outcomes.append((params, copies, optimizer.state[params[0]]["step"].item()))
    (fused_params, fused_copies, fused_step), (params, copies, step) = outcomes
    assert fused_step == step == 19
    assert_within_drift(fused_params, params, drift)
    for b, copy in zip(params, copies):
        assert torch.equal(copy, b.detach().to(torch.bfloat16))
