"""gpuops.GradScaler against torch.amp.GradScaler on the same scripted gradients, with inf/nan injected."""

import copy
import random

import pytest
import torch

import gpuops

from conftest import DEVICES


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(17, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5))


def scripted_run(scaler, model, optimizer, steps, overflow_steps, seed):
    """Backward of a scaled loss, with inf or nan planted in one gradient on the overflow steps."""
    generator = torch.Generator().manual_seed(seed)
    history = []
    for step in range(steps):
        x = torch.randn(8, 17, generator=generator).to(next(model.parameters()).device)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(model(x).square().mean()).backward()
        if step in overflow_steps:
            grad = list(model.parameters())[step % 4].grad
            grad.view(-1)[step % grad.numel()] = float("inf") if step % 2 else float("nan")
        before = [p.detach().clone() for p in model.parameters()]
        state_before = copy.deepcopy(optimizer.state_dict())
        scaler.step(optimizer)
        scaler.update()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        history.append((scaler.get_scale(), unchanged, state_before if step in overflow_steps else None))
    return history


@pytest.mark.parametrize("device", DEVICES)
def test_same_scale_and_skipped_steps_as_torch(device):
    seed = random.randint(0, 2**31)
    rng = random.Random(seed)
    steps = 60
    overflow_steps = set(rng.sample(range(steps), 15))
    kwargs = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)

    ours_model, torch_model = make_model(seed).to(device), make_model(seed).to(device)
    ours_opt = torch.optim.AdamW(ours_model.parameters(), lr=1e-3)
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-3)
    ours = gpuops.GradScaler(device, **kwargs)
    reference = torch.amp.GradScaler(device, **kwargs)

    ours_history = scripted_run(ours, ours_model, ours_opt, steps, overflow_steps, seed)
    torch_history = scripted_run(reference, torch_model, torch_opt, steps, overflow_steps, seed)

    assert [h[0] for h in ours_history] == [h[0] for h in torch_history]
    for step, (scale, unchanged, _) in enumerate(ours_history):
        assert unchanged == (step in overflow_steps), step
    for a, b in zip(ours_model.parameters(), torch_model.parameters()):
        assert torch.equal(a, b)
    assert ours.skipped_steps == len(overflow_steps)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaler_kind", ["gpuops", "torch"])
@pytest.mark.parametrize("optimizer_kind", ["gpuops", "torch-fused"])
def test_scalers_and_fused_optimizers_mix_both_ways(scaler_kind, optimizer_kind, device):
    """The device hand-off (_step_supports_amp_scaling: the scaler sets grad_scale and found_inf, the
    optimizer divides and skips) works across the libraries: our scaler drives torch's fused AdamW, torch's
    drives ours. Same scale history and skipped steps as torch's scaler with torch's for-loop AdamW."""
    seed = random.randint(0, 2**31)
    steps, overflow_steps = 12, {3, 7, 8}
    kwargs = dict(init_scale=2.0**10, growth_interval=3)
    model, ref_model = make_model(seed).to(device), make_model(seed).to(device)
    if optimizer_kind == "gpuops":
        optimizer = gpuops.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = (gpuops.GradScaler if scaler_kind == "gpuops" else torch.amp.GradScaler)(device, **kwargs)
    ref_optimizer = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, foreach=False)
    history = scripted_run(scaler, model, optimizer, steps, overflow_steps, seed)
    ref_history = scripted_run(torch.amp.GradScaler(device, **kwargs), ref_model, ref_optimizer, steps,
                               overflow_steps, seed)
    assert [h[:2] for h in history] == [h[:2] for h in ref_history]  # scale after each step, skipped or not
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_overflow_step_leaves_parameters_and_optimizer_state_bit_identical():
    model = make_model(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = gpuops.GradScaler("cpu", init_scale=256.0)
    scripted_run(scaler, model, optimizer, 3, set(), 1)  # creates optimizer state
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(optimizer.state_dict())
    scripted_run(scaler, model, optimizer, 1, {0}, 2)
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    after = optimizer.state_dict()
    for key, value in state["state"].items():
        for name, tensor in value.items():
            assert torch.equal(tensor, after["state"][key][name])
    assert bool(scaler.step_applied) is False


def test_state_dict_moves_between_torch_and_gpuops_both_ways():
    ours = gpuops.GradScaler("cpu", init_scale=1024.0, growth_interval=7, hysteresis=3)
    model = make_model(3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scripted_run(ours, model, optimizer, 5, {2}, 3)
    reference = torch.amp.GradScaler("cpu")
    reference.load_state_dict(ours.state_dict())
    assert reference.get_scale() == ours.get_scale()
    assert reference.state_dict()["_growth_tracker"] == ours.state_dict()["_growth_tracker"]

    back = gpuops.GradScaler("cpu")
    back.load_state_dict(reference.state_dict())
    assert back.get_scale() == reference.get_scale()
    assert back.state_dict()["_growth_tracker"] == reference.state_dict()["_growth_tracker"]
    assert back.get_growth_interval() == 7


def test_unscale_accepts_16_bit_gradients_and_matches_float64():
    model = torch.nn.Linear(64, 31).to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = gpuops.GradScaler("cpu", init_scale=512.0)
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    scaler.scale(model(x).float().sum()).backward()
    scaled = [p.grad.double().clone() for p in model.parameters()]
    scaler.unscale_(optimizer)
    for raw, p in zip(scaled, model.parameters()):
        torch.testing.assert_close(p.grad.double(), (raw / 512.0).to(torch.bfloat16).double(), rtol=0, atol=0)


def test_misuse_raises_errors_that_say_what_to_do():
    model = make_model(4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = gpuops.GradScaler("cpu")
    scaler.scale(model(torch.randn(2, 17)).sum()).backward()
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="once per step"):
        scaler.unscale_(optimizer)
    empty = torch.optim.SGD([torch.nn.Parameter(torch.randn(3))], lr=0.1)
    with pytest.raises(RuntimeError, match="backward"):
        scaler.step(empty)
    for kwargs, name in [({"growth_factor": 0.9}, "growth_factor"), ({"backoff_factor": 1.0}, "backoff_factor"),
                         ({"growth_interval": 0}, "growth_interval"), ({"hysteresis": 0}, "hysteresis"),
                         ({"init_scale": -1.0}, "init_scale")]:
        with pytest.raises(ValueError, match=name):
            gpuops.GradScaler("cpu", **kwargs)


def test_sparse_gradients_step_torch_optimizers_and_are_refused_by_ours():
    """As torch's scaler: a sparse gradient is unscaled through its (coalesced) values, so torch's SGD steps
    on it; our fused optimizers take dense gradients only and say so."""
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    reference = copy.deepcopy(embedding)
    start = embedding.weight.detach().clone()
    for module, scaler in ((embedding, gpuops.GradScaler("cpu", init_scale=8.0)),
                           (reference, torch.amp.GradScaler("cpu", init_scale=8.0))):
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        scaler.scale(module(torch.tensor([1, 2, 2, 7])).square().sum()).backward()
        scaler.step(optimizer)
        scaler.update()
    # torch's scaler leaves float32 duplicates uncoalesced, ours sums them first: the same up to rounding
    torch.testing.assert_close(embedding.weight, reference.weight, rtol=1e-6, atol=1e-7)
    assert not torch.equal(embedding.weight, start)  # it did step
    ours = gpuops.optim.AdamW(embedding.parameters())
    scaler = gpuops.GradScaler("cpu")
    scaler.scale(embedding(torch.tensor([1])).sum()).backward()
    with pytest.raises(ValueError, match="sparse"):
        scaler.step(ours)


def test_disabled_scaler_is_a_pass_through():
    model = make_model(5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = gpuops.GradScaler("cpu", enabled=False)
    loss = model(torch.randn(2, 17)).sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(optimizer)
    scaler.update()
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}


def test_smaller_torch_behaviours():
    """step() before scale() says what to do; update(new_scale) still counts a skipped step and takes any
    floating one-element tensor; scale() maps over a generator; a bad state_dict changes nothing."""
    model = make_model(4)
    scaler = gpuops.GradScaler("cpu", init_scale=64.0)
    with pytest.raises(RuntimeError, match=r"before any scale\(\)"):
        scaler.step(gpuops.optim.AdamW(model.parameters()))
    optimizer = gpuops.optim.AdamW(model.parameters())
    scripted_run(scaler, model, optimizer, 1, set(), 4)
    scaler.scale(model(torch.randn(2, 17)).sum()).backward()
    next(model.parameters()).grad[0, 0] = float("inf")
    scaler.step(optimizer)
    scaler.update(torch.tensor(8.0, dtype=torch.float64))
    assert scaler.skipped_steps == 1 and scaler.get_scale() == 8.0
    losses = [torch.ones(()), torch.full((), 2.0)]
    assert [float(t) for t in scaler.scale(loss for loss in losses)] == [8.0, 16.0]
    state = scaler.state_dict()
    with pytest.raises(TypeError, match="_growth_tracker must be a real number, got None"):
        scaler.load_state_dict(dict(state, scale=1.0, _growth_tracker=None))
    assert scaler.state_dict() == state


@pytest.mark.skipif(torch.cuda.is_available(), reason="the case of a machine without CUDA")
def test_the_default_scaler_disables_itself_on_a_machine_without_a_gpu_as_torchs_does():
    with pytest.warns(UserWarning, match="CUDA is not available. Disabling"):
        ours = gpuops.GradScaler()
    with pytest.warns(UserWarning, match="CUDA is not available"):
        theirs = torch.amp.GradScaler()
    assert not ours.is_enabled() and not theirs.is_enabled()
    loss = torch.ones((), requires_grad=True)
    assert ours.scale(loss) is loss  # a disabled scaler passes the loss through, as torch's
