"""PyTorch's own grad-scaling tests, carried over to gpuops.GradScaler.

Origin: the ``test_grad_scaling_*`` tests (and ``test_pickle_gradscaler``, ``test_grad_scale_will_not_overflow``,
``test_params_invalidated_with_grads_invalidated_between_unscale_and_step``, ``test_grad_scaler_pass_itself``) of
PyTorch's test/test_torch.py (TestTorchDeviceType), restated in our own words. They drive the helpers the
installed wheel ships (torch.testing._internal.common_cuda: ``_create_scaling_case``,
``_create_scaling_models_optimizers``), and where torch's test compares, torch's own GradScaler on the same
models and data is the reference. Torch's tests reach into private scaler methods (``_unscale_grads_``); these
go through the public ``unscale_`` instead. Intended differences are asserted as such (see the end).
"""

import pickle
import random
from itertools import chain

import pytest
import torch
from torch.testing._internal.common_cuda import _create_scaling_case, _create_scaling_models_optimizers

import gpuops

from conftest import DEVICES

SCALERS = {"gpuops": gpuops.GradScaler, "torch": torch.amp.GradScaler}


def fresh_seed() -> int:
    return random.randint(0, 2**31 - 1)


def optimizer_over(grads, device):
    """An SGD optimizer whose parameters carry `grads` (any layout, as a test sets them)."""
    params = [torch.zeros(g.shape, dtype=g.dtype, device=device) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    return torch.optim.SGD(params, lr=1.0)


# --------------------------------------------------------------------------- unscale (test_grad_scaling_unscale)
def storm_grads(base, inject_inf):
    """torch's "perfect storm": contiguous, sliced (neither contiguous nor dense) and float16 gradients mixed,
    optionally with an inf planted in one of them."""
    grads = [base.clone(), base.clone()[:, :5], base.to(torch.float16), base.to(torch.float16).t()]
    if inject_inf >= 0:
        grads[inject_inf][2, 2] = float("inf")
    return grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unscale_finds_an_inf_in_any_layout_and_dtype_and_divides_the_rest(device, dtype):
    base = torch.full((20, 20), 4.0, dtype=dtype, device=device)
    for inject_inf in range(-1, 4):
        scaler = gpuops.GradScaler(device, init_scale=4.0)
        scaler.scale(torch.ones((), device=device))
        grads = storm_grads(base, inject_inf)
        optimizer = optimizer_over(grads, device)
        scaler.unscale_(optimizer)
        found = sum(f.item() for f in scaler._per_optimizer[id(optimizer)]["found_inf_per_device"].values())
        if inject_inf < 0:
            assert found == 0
            for p in optimizer.param_groups[0]["params"]:  # the views were written in place, not replaced
                torch.testing.assert_close(p.grad, torch.ones_like(p.grad), rtol=1e-5, atol=1e-7)
        else:
            assert found == 1


@pytest.mark.parametrize("device", DEVICES)
def test_the_unscale_op_matches_torchs_kernel_on_dense_and_strided_grads(device):
    """The raw cases of test_grad_scaling_unscale, against torch._amp_foreach_non_finite_check_and_unscale_."""
    g = torch.randn(20, 20, device=device) * 100
    ginf, gnan = g.clone(), g.clone()
    ginf[2, 2], gnan[2, 2] = float("inf"), float("nan")
    cases = [[g, g.t()], [g, g[:, :5]], [g[:, :5], g[:, ::3]], [g, ginf], [g, gnan], [g, ginf[:, :5]],
             [g, gnan[:, :5]], [ginf, g[:, :5]], [ginf[:, :5], g[:, :5]], [g, g.double()[1::2]]]
    inv = torch.full((1,), 0.25, device=device)
    for case in cases:
        ours, theirs = [], []
        for t in case:  # the same layout in fresh storage, for each side
            block = t._base if t._base is not None else t
            for side in (ours, theirs):
                side.append(block.clone().as_strided(t.size(), t.stride(), t.storage_offset()))
        found_ours, found_theirs = torch.zeros(1, device=device), torch.zeros(1, device=device)
        torch.ops.gpuops.unscale_and_check_(ours, found_ours, inv)
        torch._amp_foreach_non_finite_check_and_unscale_(theirs, found_theirs, inv)
        assert found_ours.item() == found_theirs.item()
        if found_theirs.item() == 0:
            for a, b in zip(ours, theirs):
                assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_an_expanded_gradient_is_refused_before_anything_changes(device):
    """Overlapping memory cannot be unscaled in place: torch's kernel raises a RuntimeError; ours a ValueError
    naming the gradient, and the other gradients stay as they were (an intended difference: the type)."""
    scaler = gpuops.GradScaler(device, init_scale=4.0)
    scaler.scale(torch.ones((), device=device))
    dense = torch.full((3, 4), 8.0, device=device)
    optimizer = optimizer_over([dense, torch.full((1, 4), 8.0, device=device).expand(3, 4)], device)
    with pytest.raises(ValueError, match=r"grads\[1\].*expanded"):
        scaler.unscale_(optimizer)
    assert torch.equal(dense, torch.full((3, 4), 8.0, device=device))


# ----------------------------------------------------------------- update (test_grad_scaling_update_scale)
@pytest.mark.parametrize("device", DEVICES)
def test_the_scale_update_follows_torchs_growth_and_backoff(device):
    growth, backoff, interval = 2.0, 0.25, 2
    ours = [torch.full((1,), 4.0, device=device), torch.zeros(1, dtype=torch.int32, device=device),
            torch.ones(1, dtype=torch.int32, device=device)]
    theirs = [torch.full((1,), 4.0, device=device), torch.zeros(1, dtype=torch.int32, device=device)]
    rng = random.Random(fresh_seed())
    for found in [0.0, 0.0, 1.0] + [float(rng.random() < 0.3) for _ in range(20)]:
        flag = torch.full((1,), found, device=device)
        torch.ops.gpuops.update_scale_(ours[0], ours[1], ours[2], flag, growth, backoff, interval, 1, 0.0, 0.0)
        torch._amp_update_scale_(theirs[0], theirs[1], flag, growth, backoff, interval)
        assert ours[0].item() == theirs[0].item() and ours[1].item() == theirs[1].item()


# ---------------------------------------------------------------- sparse (test_grad_scaling_unscale_sparse)
@pytest.mark.parametrize("device", DEVICES)
def test_sparse_gradients_are_unscaled_and_an_overflow_of_their_duplicates_is_found(device):
    i = torch.tensor([[0, 1, 1], [2, 0, 2]], device=device)
    s = torch.sparse_coo_tensor(i, torch.tensor([16.0, 32.0, 64.0], device=device), (2, 3))

    def unscale(grad):
        scaler = gpuops.GradScaler(device, init_scale=4.0)
        scaler.scale(torch.ones((), device=device))
        param = torch.zeros(2, 3, dtype=grad.dtype, device=device)
        param.grad = grad
        optimizer = torch.optim.SGD([param], lr=1.0)
        scaler.unscale_(optimizer)
        found = sum(f.item() for f in scaler._per_optimizer[id(optimizer)]["found_inf_per_device"].values())
        return param.grad, found

    grad, found = unscale(s.clone())
    assert found == 0 and torch.equal(grad.to_dense(), (s / 4).to_dense())
    for bad in (float("inf"), float("nan")):
        assert unscale(torch.sparse_coo_tensor(i, torch.tensor([16.0, 32.0, bad], device=device), (2, 3)))[1] == 1
    grad, found = unscale(s.clone().half())
    assert found == 0 and torch.equal(grad.to_dense(), (s.half() / 4).to_dense())
    # duplicates that fit float16 one by one but not summed (64000 + 64000): the overflow is found
    dup = torch.sparse_coo_tensor(torch.tensor([[0, 1, 0], [2, 0, 2]], device=device),
                                  torch.tensor([64000.0, 32.0, 64000.0], device=device), (2, 3)).half()
    assert unscale(dup)[1] == 1


# ---------------------------------------------------------- state_dict and pickling (test_grad_scaling_state_dict)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("source, target", [("torch", "gpuops"), ("gpuops", "torch"), ("gpuops", "gpuops")])
@pytest.mark.parametrize("lazy_init", [True, False])
def test_state_dict_loads_across_the_libraries(device, source, target, lazy_init):
    s0 = SCALERS[source](device, init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    s1 = SCALERS[target](device, init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    s1._init_growth_tracker = 7  # a value for load_state_dict to overwrite
    if lazy_init:
        s1.scale(torch.full((1,), 4.0, device=device))
        assert s1._scale.device.type == torch.device(device).type and s1._scale.dtype == torch.float32
    s1.load_state_dict(s0.state_dict())
    assert (s1.get_scale(), s1.get_growth_factor(), s1.get_backoff_factor(), s1.get_growth_interval()) == (
        3.0, 4.0, 0.5, 2)
    assert s1._init_growth_tracker == 0
    if lazy_init:
        assert s1.scale(torch.full((1,), 4.0, device=device)).item() == 12.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lazy_init", [True, False])
def test_a_pickled_scaler_keeps_its_settings(device, lazy_init):
    """test_pickle_gradscaler."""
    a = gpuops.GradScaler(device, init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    assert a.is_enabled()
    if lazy_init:
        a.scale(torch.tensor([4.0], device=device))
    b = pickle.loads(pickle.dumps(a))
    assert b.is_enabled() and b.get_scale() == 3.0 and b.get_growth_factor() == 4.0
    assert b.get_backoff_factor() == 0.5 and b.get_growth_interval() == 2 and b._init_growth_tracker == 0
    if lazy_init:
        assert b.scale(torch.tensor([4.0], device=device)).item() == 12.0


# ------------------------------------------------------------------------------ whole steps (_run_scaling_case)
def run_scaling_case(device, run, unskipped, skipped, scaler_cls, seed, atol=1e-7, optimizer_ctor=torch.optim.SGD,
                     optimizer_kwargs=None):
    """torch's _run_scaling_case: the same steps with and without the scaling API (with the skipped step left
    out of the control), scaling enabled and disabled; the scale must have grown `unskipped` times and backed
    off `skipped` times, and gradients, optimizer state and parameters must match the control. Returns the
    scaled model of the enabled run, for comparison with torch's scaler."""
    scaled_model = None
    for enabled in (True, False):
        torch.manual_seed(seed)
        mod_control, mod_scaling, opt_control, opt_scaling, data, loss_fn, skip_iter = _create_scaling_case(
            device=device, optimizer_ctor=optimizer_ctor, optimizer_kwargs=optimizer_kwargs)
        scaler = scaler_cls(device, init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)
        run(device, data, mod_control, opt_control, scaler, loss_fn, skip_iter, False)
        scaler = run(device, data, mod_scaling, opt_scaling, scaler, loss_fn, skip_iter, True) or scaler
        if enabled:
            growth = scaler.get_growth_factor() ** unskipped
            assert scaler.get_scale() == 128.0 * growth * scaler.get_backoff_factor() ** skipped
            scaled_model = (mod_scaling, scaler.get_scale())
        else:
            assert scaler.get_scale() == 1.0
        for c, s in zip(mod_control.parameters(), mod_scaling.parameters()):
            torch.testing.assert_close(c.grad, s.grad, atol=atol, rtol=1e-5)
            for key, value in opt_control.state[c].items():
                torch.testing.assert_close(value, opt_scaling.state[s][key], atol=atol, rtol=1e-5, msg=key)
            torch.testing.assert_close(c, s, atol=atol, rtol=1e-5)
    return scaled_model


def same_as_torchs_scaler(device, run, **kwargs):
    """Ours against the control (torch's test), then ours against torch's scaler on the same run: same scale,
    parameters within float rounding."""
    seed = fresh_seed()
    ours, ours_scale = run_scaling_case(device, run, scaler_cls=gpuops.GradScaler, seed=seed, **kwargs)
    theirs, theirs_scale = run_scaling_case(device, run, scaler_cls=torch.amp.GradScaler, seed=seed, **kwargs)
    assert ours_scale == theirs_scale
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def autocast_run(pickle_each_step):
    """test_grad_scaling_autocast's run: float16 autocast with the scaling API, an inf planted on skip_iter."""
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (inputs, target) in enumerate(data):
            optimizer.zero_grad()
            with torch.autocast(device_type=device, dtype=torch.half, enabled=try_scaling_api):
                loss = loss_fn(model(inputs), target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    with torch.no_grad():
                        model[1].weight.grad.fill_(float("inf"))
                scaler.step(optimizer)
                scaler.update()
                if pickle_each_step:
                    scaler = pickle.loads(pickle.dumps(scaler))
            else:
                loss.backward()
                if not scaler.is_enabled() or i != skip_iter:
                    optimizer.step()
        return scaler
    return run


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pickle_each_step", [False, True])
def test_autocast_steps_match_the_fp32_control_with_sgd(device, pickle_each_step):
    """test_grad_scaling_autocast with SGD (atol 1e-3: float16 autocast against float32)."""
    same_as_torchs_scaler(device, autocast_run(pickle_each_step), unskipped=3, skipped=1, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer_ctor", [torch.optim.Adam, torch.optim.AdamW, gpuops.optim.AdamW])
def test_autocast_steps_with_adam_match_torchs_scaler(device, optimizer_ctor):
    """test_grad_scaling_autocast with Adam/AdamW: torch's test expects these to miss the float32 control
    (Adam normalises away the float16 error less forgivingly), so the reference here is torch's scaler on the
    same autocast run, and the scale history."""
    seed = fresh_seed()
    results = []
    for scaler_cls in (gpuops.GradScaler, torch.amp.GradScaler):
        torch.manual_seed(seed)
        _, model, _, optimizer, data, loss_fn, skip_iter = _create_scaling_case(
            device=device, optimizer_ctor=optimizer_ctor, optimizer_kwargs={"lr": 1e-2})
        scaler = scaler_cls(device, init_scale=128.0, growth_factor=2.0, growth_interval=1)
        autocast_run(False)(device, data, model, optimizer, scaler, loss_fn, skip_iter, True)
        results.append((scaler.get_scale(), [p.detach().clone() for p in model.parameters()]))
    assert results[0][0] == results[1][0] == 128.0 * 2.0**3 * 0.5
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_clipping_the_scaled_gradients_by_a_scaled_norm(device):
    """test_grad_scaling_clipping: clip_grad_norm_ on scaled gradients with max_norm * scale."""
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2
        for i, (inputs, target) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(inputs), target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if not scaler.is_enabled() or i != skip_iter:
                    optimizer.step()

    same_as_torchs_scaler(device, run, unskipped=3, skipped=1, atol=1e-5)


def clip_after_unscale_run(clip):
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2
        for i, (inputs, target) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(inputs), target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.unscale_(optimizer)
                clip(model.parameters(), max_norm, error_if_nonfinite=False)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                clip(model.parameters(), max_norm)
                if not scaler.is_enabled() or i != skip_iter:
                    optimizer.step()
    return run


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("clip", [torch.nn.utils.clip_grad_norm_, gpuops.clip_grad_norm_], ids=["torch", "gpuops"])
def test_clipping_after_a_separate_unscale(device, clip):
    """test_grad_scaling_clipping_separate_unscale, with torch's clip_grad_norm_ and ours."""
    same_as_torchs_scaler(device, clip_after_unscale_run(clip), unskipped=3, skipped=1)


@pytest.mark.parametrize("device", DEVICES)
def test_a_gradient_penalty_through_autograd_grad(device):
    """test_grad_scaling_penalty: autograd.grad of the scaled loss with create_graph, unscaled by hand."""
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (inputs, target) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(inputs), target)
            if try_scaling_api:
                grads = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
                grads = [g * (1.0 / scaler.get_scale()) for g in grads]
            else:
                grads = torch.autograd.grad(loss, model.parameters(), create_graph=True)
            loss = loss + sum(g.pow(2).sum() for g in grads).sqrt()
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if not scaler.is_enabled() or i != skip_iter:
                    optimizer.step()

    same_as_torchs_scaler(device, run, unskipped=3, skipped=1)


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_accumulation_over_two_backwards(device):
    """test_grad_scaling_accumulation."""
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (inputs, target) in enumerate(data):
            loss = loss_fn(model(inputs), target) / 2
            (scaler.scale(loss) if try_scaling_api else loss).backward()
            if (i + 1) % 2 == 0:
                if try_scaling_api:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad()

    same_as_torchs_scaler(device, run, unskipped=2, skipped=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("enabled", [True, False])
def test_two_models_two_optimizers_two_losses(device, enabled):
    """test_grad_scaling_multiple: both losses reach both models; one optimizer unscaled separately; the
    inf in model 1 skips optimizer 1 only in the control, and both steps under the scaler."""
    torch.manual_seed(fresh_seed())
    mod_control0, mod_scaling0, opt_control0, opt_scaling0, data, loss_fn, skip_iter = _create_scaling_case(device)
    mod_control1, mod_scaling1, opt_control1, opt_scaling1 = _create_scaling_models_optimizers(device)
    scaler = gpuops.GradScaler(device, init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)

    def run(model0, model1, optimizer0, optimizer1, try_scaling_api):
        for i, (inputs, target) in enumerate(data):
            optimizer0.zero_grad()
            optimizer1.zero_grad()
            out0, out1 = model0(inputs), model1(inputs)
            loss0 = loss_fn(0.3 * out0 + 0.7 * out1, target)
            loss1 = loss_fn(0.6 * out0 - 0.4 * out1, target)
            if try_scaling_api:
                scaler.scale(loss0).backward(retain_graph=True)
                scaler.scale(loss1).backward()
                if i == skip_iter and scaler.is_enabled():
                    model1[1].weight.grad.data.fill_(float("inf"))
                scaler.unscale_(optimizer0)
                scaler.step(optimizer0)
                scaler.step(optimizer1)
                scaler.update()
            else:
                loss0.backward(retain_graph=True)
                loss1.backward()
                optimizer0.step()
                if not scaler.is_enabled() or i != skip_iter:
                    optimizer1.step()

    run(mod_control0, mod_control1, opt_control0, opt_control1, False)
    run(mod_scaling0, mod_scaling1, opt_scaling0, opt_scaling1, True)
    # one scale for both optimizers: an inf in either backs it off, for both
    assert scaler.get_scale() == (128.0 * 2.0**3 * 0.5 if enabled else 1.0)
    for c, s in zip(chain(mod_control0.parameters(), mod_control1.parameters()),
                    chain(mod_scaling0.parameters(), mod_scaling1.parameters())):
        torch.testing.assert_close(c, s, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------------------- misuse and edges
@pytest.mark.parametrize("device", DEVICES)
def test_unscale_twice_in_one_step_raises(device):
    """torch's scaler raises when unscale_ runs twice before update(); so does ours, and update() resets it."""
    model = torch.nn.Linear(4, 2).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = gpuops.GradScaler(device)
    for _ in range(2):
        scaler.scale(model(torch.randn(3, 4, device=device)).sum()).backward()
        scaler.unscale_(optimizer)
        with pytest.raises(RuntimeError, match="already"):
            scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer_ctor", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, gpuops.optim.AdamW])
def test_gradients_broken_after_unscale_still_step(device, optimizer_ctor):
    """test_params_invalidated_with_grads_invalidated_between_unscale_and_step: the inf/nan check belongs to
    unscale_; gradients broken after it are stepped with, and the parameters become inf/nan."""
    torch.manual_seed(fresh_seed())
    model, _, optimizer, _, data, loss_fn, _ = _create_scaling_case(device, optimizer_ctor=optimizer_ctor)
    scaler = gpuops.GradScaler(device, init_scale=128.0)
    for inputs, target in data:
        optimizer.zero_grad()
        with torch.autocast(device_type=device, dtype=torch.half):
            loss = loss_fn(model(inputs), target)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        for j, param in enumerate(model.parameters()):
            param.grad.copy_(torch.inf if j % 2 else torch.nan)
        scaler.step(optimizer)
        scaler.update()
    assert all(p.isnan().any() or p.isinf().any() for p in model.parameters())


@pytest.mark.parametrize("device", DEVICES)
def test_the_scale_never_grows_to_inf(device):
    """test_grad_scale_will_not_overflow: growth from 1e38 by 16 stays finite."""
    model = torch.nn.Linear(5, 1).to(device)
    optimizer = torch.optim.Adam(model.parameters())
    scaler = gpuops.GradScaler(device, growth_interval=1, growth_factor=2.0**4, init_scale=1e38)
    loss = ((model(torch.randn(1, 5, device=device)) - 1e-30 * torch.randn(1, 1, device=device)) ** 2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    assert torch.isfinite(scaler._scale).all()


@pytest.mark.parametrize("device", DEVICES)
def test_an_amp_aware_optimizer_gets_grad_scale_and_found_inf(device):
    """test_grad_scaler_pass_itself, second half: an optimizer with _step_supports_amp_scaling sees grad_scale
    and found_inf tensors during its step, and neither afterwards. (The first half, torch's deprecated
    step(grad_scaler=...) hand-off, is refused: the next test.)"""
    seen = {}

    class AmpAware(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})
            self._step_supports_amp_scaling = True

        def step(self, closure=None):
            seen["grad_scale"], seen["found_inf"] = self.grad_scale, self.found_inf

    model = torch.nn.Linear(4, 1).to(device)
    optimizer = AmpAware(model.parameters())
    scaler = gpuops.GradScaler(device, init_scale=2.0)
    scaler.scale(model(torch.randn(4, 4, device=device)).mean()).backward()
    scaler.step(optimizer)
    scaler.update()
    assert isinstance(seen["grad_scale"], torch.Tensor) and isinstance(seen["found_inf"], torch.Tensor)
    assert not hasattr(optimizer, "grad_scale") and not hasattr(optimizer, "found_inf")


def test_the_deprecated_grad_scaler_hand_off_is_refused_before_anything_changes():
    """test_grad_scaler_pass_itself, first half: an optimizer whose step takes grad_scaler= expects torch's
    scaler to pass itself (torch warns FutureWarning) and calls its private methods; ours does not pass itself,
    and stepping it would skip the unscale silently, so it is a TypeError naming the hand-off to use."""
    calls = []

    class OldStyle(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})
            self._step_supports_amp_scaling = True

        def step(self, closure=None, *, grad_scaler=None):
            calls.append(grad_scaler)

    model = torch.nn.Linear(4, 1)
    optimizer = OldStyle(model.parameters())
    scaler = gpuops.GradScaler("cpu", init_scale=2.0)
    scaler.scale(model(torch.randn(4, 4)).mean()).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(TypeError, match="OldStyle.step takes grad_scaler=.*self.grad_scale and self.found_inf"):
        scaler.step(optimizer)
    assert calls == [] and not hasattr(optimizer, "grad_scale")
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))  # nothing was unscaled
    with pytest.warns(FutureWarning, match="GradScaler is going to stop passing itself"):  # torch's, for contrast
        theirs = torch.amp.GradScaler("cpu", init_scale=2.0)
        theirs.scale(model(torch.randn(4, 4)).mean()).backward()
        theirs.step(optimizer)
    assert isinstance(calls[-1], torch.amp.GradScaler)


@pytest.mark.parametrize("device", DEVICES)
def test_non_dense_gradient_views_step_as_under_torchs_scaler(device):
    """A gradient that is a strided view of a larger buffer (a slice, a step) is unscaled in place and stepped
    on, with and without a separate unscale_ and clipping, as torch's scaler does (it was refused)."""
    seed = fresh_seed()
    results = []
    for scaler_cls in (gpuops.GradScaler, torch.amp.GradScaler):
        generator = torch.Generator().manual_seed(seed)
        params = [torch.randn(6, 5, generator=generator).to(device), torch.randn(7, generator=generator).to(device)]
        optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        scaler = scaler_cls(device, init_scale=2.0**8, growth_interval=1)
        for step in range(4):
            scaler.scale(torch.ones((), device=device))  # the scale lives on the device from here on
            scale = scaler.get_scale()
            buffers = [torch.randn(6, 10, generator=generator).to(device), torch.randn(21, generator=generator).to(device)]
            params[0].grad = (buffers[0] * scale)[:, ::2]  # strided views into fresh storage
            params[1].grad = (buffers[1] * scale)[::3]
            if step == 2:
                params[1].grad[0] = float("inf")
            if step % 2:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            scaler.step(optimizer)
            scaler.update()
        results.append((scaler.get_scale(), [p.clone() for p in params]))
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_our_clip_grad_norm_takes_non_dense_views_as_torchs_does(device):
    grads = torch.randn(8, 12, device=device) * 3
    ours_p, theirs_p = torch.zeros(8, 6, device=device), torch.zeros(8, 6, device=device)
    ours_p.grad, theirs_p.grad = grads.clone()[:, ::2], grads.clone()[:, ::2]
    scaler = gpuops.GradScaler(device, init_scale=4.0)
    scaler.scale(torch.ones((), device=device))
    optimizer = torch.optim.SGD([ours_p], lr=1.0)
    ours_p.grad.mul_(4.0)
    norm = scaler.clip_grad_norm_(optimizer, 0.5)
    reference = torch.nn.utils.clip_grad_norm_([theirs_p], 0.5)
    torch.testing.assert_close(norm, reference)
    torch.testing.assert_close(ours_p.grad, theirs_p.grad)
    torch.testing.assert_close(gpuops.clip_grad_norm_([ours_p], 0.1), torch.nn.utils.clip_grad_norm_([theirs_p], 0.1))
    torch.testing.assert_close(ours_p.grad, theirs_p.grad)
