"""Precision per device generation, and the shared dynamic loss scale."""

import pytest
import torch

from hetcomm.amp import DynamicLossScaler, compute_precision


@pytest.mark.parametrize("capability, expected", [
    ((6, 0), "fp16"),   # P100: fast fp16, no bf16
    ((6, 1), "fp16"),   # GTX 1080 Ti / Titan Xp / P40: fp16 storage, fp32 math (cuBLAS), faster than fp32
    ((7, 0), "fp16"),   # V100
    ((7, 5), "fp16"),   # T4, RTX 2080 Ti
    ((8, 0), "bf16"),   # A100
    ((8, 6), "bf16"),   # RTX 3090
    ((9, 0), "bf16"),
])
def test_precision_policy_by_compute_capability(monkeypatch, capability, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert compute_precision(torch.device("cuda", 0)) == expected


def test_cpu_trains_in_fp32():
    assert compute_precision(torch.device("cpu")) == "fp32"


def test_a_requested_precision_overrides_the_policy(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    assert compute_precision(torch.device("cuda", 0), "fp32") == "fp32"
    assert compute_precision(torch.device("cpu"), "bf16") == "bf16"
    with pytest.raises(ValueError, match=r"--precision bf16: Tesla V100-SXM2-16GB \(sm_70\) has no bf16 arithmetic"):
        compute_precision(torch.device("cuda", 0), "bf16")
    with pytest.raises(ValueError, match=r"precision 'fp8': expected auto or one of fp32, fp16, bf16"):
        compute_precision(torch.device("cpu"), "fp8")


def test_loss_scaler_backs_off_and_grows_like_gradscaler():
    scaler = DynamicLossScaler(scale=1024.0, growth_interval=3)
    scaler.update(found_inf=True)
    assert scaler.scale == 512.0
    for _ in range(2):
        scaler.update(found_inf=False)
    assert scaler.scale == 512.0
    scaler.update(found_inf=False)
    assert scaler.scale == 1024.0
    scaler.update(found_inf=False)
    scaler.update(found_inf=True)  # an overflow restarts the count of clean steps
    scaler.update(found_inf=False)
    scaler.update(found_inf=False)
    assert scaler.scale == 512.0


def test_loss_scaler_state_round_trip_and_floor():
    scaler = DynamicLossScaler(scale=2.0, min_scale=1.0)
    for _ in range(5):
        scaler.update(found_inf=True)
    assert scaler.scale == 1.0
    copy = DynamicLossScaler()
    copy.load_state_dict(scaler.state_dict())
    assert copy.scale == scaler.scale and copy.clean_steps == scaler.clean_steps


def test_loss_scaler_rejects_nonsense():
    with pytest.raises(ValueError, match="invalid settings"):
        DynamicLossScaler(backoff_factor=2.0)
