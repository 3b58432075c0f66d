"""The fused pass 1 (norm + overflow check) and clipping, against torch.nn.utils.clip_grad_norm_."""

import copy
import random

import pytest
import torch

import gpuops

from conftest import DEVICES


def params_with_grads(seed, dtype=torch.float32, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(7,), (33, 17), (70000,), (3, 5, 7)]
    params = [torch.nn.Parameter(torch.randn(s, generator=generator, dtype=torch.float64)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator, dtype=torch.float64) * scale
    return params


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_grad_norm_matches_torch_in_float64(max_norm, device):
    seed = random.randint(0, 2**31)
    reference = params_with_grads(seed)
    ours = [torch.nn.Parameter(p.detach().float().to(device)) for p in reference]
    for o, r in zip(ours, reference):
        o.grad = r.grad.float().to(device)
    expected = torch.nn.utils.clip_grad_norm_(reference, max_norm)
    total = gpuops.clip_grad_norm_(ours, max_norm)
    assert total.device.type == device
    torch.testing.assert_close(total.double().cpu(), expected, rtol=1e-6, atol=0)
    for o, r in zip(ours, reference):
        torch.testing.assert_close(o.grad.double().cpu(), r.grad, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_norm_is_deterministic_and_flags_overflow_in_16_bit_grads(device):
    grads = [torch.randn(100_003).to(torch.bfloat16).to(device), torch.randn(77).half().to(device)]
    found, quarter = torch.zeros(1, device=device), torch.full((1,), 0.25, device=device)
    first = torch.ops.gpuops.unscaled_grad_norm_(grads, quarter, found)
    again = torch.ops.gpuops.unscaled_grad_norm_(grads, quarter, found)
    assert torch.equal(first, again) and found.item() == 0.0
    reference = torch.cat([g.double().flatten() for g in grads]).mul(0.25).norm()
    torch.testing.assert_close(first.double().squeeze(), reference, rtol=1e-6, atol=0)
    grads[1][5] = float("nan")
    torch.ops.gpuops.unscaled_grad_norm_(grads, torch.ones(1, device=device), found)
    assert found.item() == 1.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer_kind", ["gpuops", "torch", "torch-fused"])
def test_scaler_clip_then_step_equals_torch_unscale_clip_step(optimizer_kind, device):
    torch.manual_seed(random.randint(0, 2**31))
    model = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.GELU(), torch.nn.Linear(48, 6)).to(device)
    reference = copy.deepcopy(model)
    if optimizer_kind == "gpuops":
        optimizer = gpuops.optim.AdamW(model.parameters(), lr=1e-2)
    else:  # torch's fused AdamW takes scale / clip_coef from our scaler, as ours does
        fused = optimizer_kind == "torch-fused"
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False, fused=fused)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    scaler = gpuops.GradScaler(device, init_scale=2.0**12)
    ref_scaler = torch.amp.GradScaler(device, init_scale=2.0**12)
    for step in range(8):
        x = torch.randn(16, 24, device=device) * 3
        optimizer.zero_grad(set_to_none=True)
        ref_optimizer.zero_grad(set_to_none=True)
        scaler.scale(model(x).square().mean()).backward()
        ref_scaler.scale(reference(x).square().mean()).backward()
        if step == 5:
            next(model.parameters()).grad[1, 2] = float("inf")
            next(reference.parameters()).grad[1, 2] = float("inf")
        norm = scaler.clip_grad_norm_(optimizer, max_norm=0.3)
        ref_scaler.unscale_(ref_optimizer)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.3)
        if step != 5:
            torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
        scaler.step(optimizer)
        ref_scaler.step(ref_optimizer)
        scaler.update()
        ref_scaler.update()
        assert scaler.get_scale() == ref_scaler.get_scale()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_misuse_and_bad_max_norm():
    model = torch.nn.Linear(3, 2)
    optimizer = gpuops.optim.AdamW(model.parameters())
    scaler = gpuops.GradScaler("cpu")
    scaler.scale(model(torch.randn(4, 3)).sum()).backward()
    with pytest.raises(ValueError, match="max_norm"):
        scaler.clip_grad_norm_(optimizer, 0.0)
    scaler.clip_grad_norm_(optimizer, 1.0)
    with pytest.raises(RuntimeError, match="clip_grad_norm_"):
        scaler.unscale_(optimizer)
    with pytest.raises(ValueError, match="max_norm"):
        gpuops.clip_grad_norm_(model.parameters(), -1.0)


def test_torch_signature_drops_in():
    """norm_type (other types are torch's own), error_if_nonfinite, foreach and max_norm=0 as torch has them."""
    seed = random.randint(0, 2**31)

    def float32_params_with_grads(seed):
        params = [torch.nn.Parameter(p.detach().float()) for p in params_with_grads(seed)]
        for p, source in zip(params, params_with_grads(seed)):
            p.grad = source.grad.float()
        return params

    exact = torch.cat([p.grad.flatten() for p in params_with_grads(seed)]).norm()  # float64
    for kwargs in (dict(norm_type=2.0), dict(norm_type=1.0), dict(norm_type=float("inf")), dict(foreach=True)):
        ours, reference = float32_params_with_grads(seed), float32_params_with_grads(seed)
        total = gpuops.clip_grad_norm_(ours, 0.5, **kwargs)
        expected = torch.nn.utils.clip_grad_norm_(reference, 0.5, **kwargs)
        if kwargs.get("norm_type", 2.0) == 2.0:  # torch's float32 2-norm is itself up to 1.1e-6 from float64
            torch.testing.assert_close(total.double(), exact, rtol=1e-6, atol=0)
        else:  # 1 and inf are exact sums and maxima
            torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
        for o, r in zip(ours, reference):
            torch.testing.assert_close(o.grad, r.grad, rtol=2e-6, atol=1e-12)
    zeroed = float32_params_with_grads(seed)
    gpuops.clip_grad_norm_(zeroed, 0.0)
    assert all(torch.count_nonzero(p.grad) == 0 for p in zeroed)
    bad = float32_params_with_grads(seed)
    bad[1].grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="error_if_nonfinite=False"):
        gpuops.clip_grad_norm_(bad, 1.0, error_if_nonfinite=True)
