"""8-bit optimizer states (issue 32): block-wise quantisation against a float64 reference, one fused step against
torch's Adam/AdamW arithmetic in float64 from the same decoded states, skipped steps, the state_dict in both
forms, and bad input."""

import copy
import random

import pytest
import torch

import gpuops
from conftest import DEVICES, requires_cuda
from parity import within_noise

BLOCK = 256
EPS32 = torch.finfo(torch.float32).eps
SUBNORMAL = 2.0**-149  # float32's spacing below its normals: decoding a subnormal block rounds to it


def book(signed: bool) -> torch.Tensor:
    """The 256 code values, read back through dequantize_state with a scale of 1 (float64)."""
    codes = torch.arange(256, dtype=torch.uint8)
    return torch.ops.gpuops.dequantize_state(codes, torch.ones(1), signed).double()


def quantize(values: torch.Tensor, signed: bool):
    codes = torch.empty_like(values, dtype=torch.uint8)
    scales = torch.empty(-(-values.numel() // BLOCK))
    torch.ops.gpuops.quantize_state_(values, codes, scales, signed)
    return codes, scales


def nearest_reference(values: torch.Tensor, signed: bool) -> torch.Tensor:
    """Float64: each element replaced by its block's nearest representable value (scale = the block's largest
    magnitude, computed in float64)."""
    values64 = values.double().reshape(-1)
    n = values64.numel()
    padded = torch.nn.functional.pad(values64, (0, -(-n // BLOCK) * BLOCK - n)).view(-1, BLOCK)
    scale = padded.abs().amax(1, keepdim=True)
    x = torch.where(scale == 0, 0.0, padded / scale)
    values_book = book(signed)
    nearest = values_book[(x.unsqueeze(-1) - values_book).abs().argmin(-1)]
    return (nearest * scale).reshape(-1)[:n].view(values.shape)


def largest_half_gap(signed: bool) -> float:
    """The largest distance from a value in [-1, 1] ([0, 1]) to its nearest code: half the widest gap, or the
    distance from -1 to the lowest signed code (there is no -1 code), which is the same 0.9 / 128."""
    values = book(signed)
    return max(float(values.diff().max()) / 2, float(1 + values[0]) if signed else 0.0)


def draw(n: int, kind: str, generator: torch.Generator, signed: bool) -> torch.Tensor:
    """Fresh random inputs: moments spread over decades, and the adversarial blocks."""
    if kind == "spread":  # magnitudes over ten decades, as a second moment has
        x = torch.randn(n, generator=generator) * torch.exp(torch.empty(n).uniform_(-23, 0, generator=generator))
    elif kind == "equal":  # every block one value repeated
        x = torch.randn(-(-n // BLOCK), generator=generator).repeat_interleave(BLOCK)[:n]
    elif kind == "outlier":  # one huge element per block beside small ones
        x = torch.randn(n, generator=generator) * 1e-3
        x[::BLOCK] = 1e4
    elif kind == "denormal":
        x = torch.randn(n, generator=generator) * 1e-39
    else:  # zeros, with one non-zero block
        x = torch.zeros(n)
        x[BLOCK:2 * BLOCK] = torch.randn(BLOCK, generator=generator)
    return x if signed else x.abs()


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("kind", ["spread", "equal", "outlier", "denormal", "zeros"])
def test_quantisation_is_the_nearest_code_per_block(signed, kind):
    """Each decoded element is the block's nearest code (as float64 finds it) up to the float32 rounding of
    value / scale; the error per block is at most the code book's largest half-gap times the block's scale (the
    bound: 0.70% of the scale signed, 0.35% unsigned); the scale is the block's largest magnitude exactly."""
    generator = torch.Generator().manual_seed(random.randint(0, 2**31))
    values = draw(5 * BLOCK + 77, kind, generator, signed)
    codes, scales = quantize(values, signed)
    decoded = torch.ops.gpuops.dequantize_state(codes, scales, signed).double()
    reference = nearest_reference(values, signed)
    blocks = torch.nn.functional.pad(values.abs(), (0, scales.numel() * BLOCK - values.numel())).view(-1, BLOCK)
    assert torch.equal(scales, blocks.amax(1))
    per_element_scale = scales.double().repeat_interleave(BLOCK)[:values.numel()]
    error, best = (decoded - values.double()).abs(), (reference - values.double()).abs()
    assert bool((error <= best + 2 * EPS32 * per_element_scale + SUBNORMAL).all()), (error - best).max()
    assert bool((error <= (largest_half_gap(signed) + 2 * EPS32) * per_element_scale + SUBNORMAL).all())
    assert largest_half_gap(True) < 0.0071 and largest_half_gap(False) < 0.0036


def test_code_books_and_nan():
    """Signed: 127 negative codes, 0, 128 positive up to 1; unsigned: [0, 1]; both seven decades deep. A block
    holding NaN keeps it (scale NaN), as a float32 state would."""
    signed, unsigned = book(True), book(False)
    assert bool((signed.diff() > 0).all()) and bool((unsigned.diff() > 0).all())
    assert signed[127] == 0 and signed[-1] == 1 and unsigned[0] == 0 and unsigned[-1] == 1
    assert 1e-7 < signed[128] < 1e-6 and 1e-7 < unsigned[1] < 1e-6
    values = torch.randn(2 * BLOCK)
    values[3] = float("nan")
    codes, scales = quantize(values, True)
    decoded = torch.ops.gpuops.dequantize_state(codes, scales, True)
    assert scales[0].isnan() and decoded[:BLOCK].isnan().all() and not decoded[BLOCK:].isnan().any()


def zero_state(like):
    codes, scales = zip(*(quantize(torch.zeros_like(like), signed) for signed in (True, False)))
    return [codes[0], scales[0], codes[1], scales[1]]


def adam_float(param, grad, m, v, step, lr, beta1, beta2, eps, wd, decoupled, dtype):
    """torch's single-tensor Adam/AdamW arithmetic in `dtype`, from decoded moments."""
    p, g, m, v = (t.to(dtype) for t in (param, grad, m, v))
    if decoupled:
        p = p * (1 - lr * wd)
    else:
        g = g + wd * p
    m = m + (1 - beta1) * (g - m)
    v = v * beta2 + (1 - beta2) * g * g
    denom = v.sqrt() / (1 - beta2**step) ** 0.5 + eps
    return p - lr / (1 - beta1**step) * m / denom, m, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decoupled", [True, False])
def test_one_step_against_float64(dtype, decoupled):
    """From random 8-bit states (a few steps in): the parameter as torch's arithmetic gives it in float64 from the
    same decoded moments, within 10x float32's own distance to it; the stored moments within the code book's
    half-gap of the float64 moments; a 16-bit parameter is its master rounded."""
    generator = torch.Generator().manual_seed(random.randint(0, 2**31))
    n = 3 * BLOCK * 7 + 5
    master = torch.randn(n, generator=generator)
    param = master.to(dtype)
    m_codes, m_scales = quantize(torch.randn(n, generator=generator) * 0.1, True)
    v_codes, v_scales = quantize(torch.rand(n, generator=generator) * 0.01, False)
    grad = torch.randn(n, generator=generator).to(dtype)
    step = torch.tensor(4.0)
    m0 = torch.ops.gpuops.dequantize_state(m_codes, m_scales, True)
    v0 = torch.ops.gpuops.dequantize_state(v_codes, v_scales, False)
    options = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.0625, decoupled=decoupled)
    p64, m64, v64 = adam_float(master, grad.float(), m0, v0, 5, dtype=torch.float64, **options)
    p32, _, _ = adam_float(master, grad.float(), m0, v0, 5, dtype=torch.float32, **options)
    masters = [master] if dtype != torch.float32 else []
    stepped = param if masters else master
    torch.ops.gpuops.adam8_step_([stepped], [grad], masters, [m_codes], [m_scales], [v_codes], [v_scales], [step],
                                 options["lr"], 0.9, 0.999, 1e-8, 0.0625, decoupled, False, None, None)
    assert step.item() == 5.0
    within_noise([master], [p64], [p32], "8-bit step, parameter")
    if masters:
        assert torch.equal(param, master.to(dtype))
    for codes, scales, reference, signed in ((m_codes, m_scales, m64, True), (v_codes, v_scales, v64, False)):
        decoded = torch.ops.gpuops.dequantize_state(codes, scales, signed).double()
        scale = reference.abs().view(-1).narrow(0, 0, n).clone()
        per_element = torch.nn.functional.pad(scale, (0, len(scales) * BLOCK - n)).view(-1, BLOCK).amax(1)
        per_element = per_element.repeat_interleave(BLOCK)[:n]
        bound = largest_half_gap(signed) * per_element * (1 + 1e-5) + 8 * EPS32 * reference.abs()
        assert bool(((decoded - reference).abs() <= bound).all())


@pytest.mark.parametrize("kind", ["spread", "equal", "outlier", "denormal", "zeros"])
def test_the_step_encodes_as_quantize_state_does(kind):
    """From zero moments with betas 0, a step's new moments are exactly the gradient and its square: the codes
    the step's own encoder wrote (bucket table and comparisons, CPU loop or CUDA kernel) are quantize_state_'s
    (a search of the same thresholds), code for code, on fresh and adversarial values."""
    generator = torch.Generator().manual_seed(random.randint(0, 2**31))
    grad = draw(9 * BLOCK + 13, kind, generator, signed=True)
    param = torch.randn(grad.numel(), generator=generator)
    state = zero_state(param)
    torch.ops.gpuops.adam8_step_([param], [grad], [], *[[t] for t in state], [torch.zeros(())], 1e-3, 0.0, 0.0,
                                 1e-8, 0.0, True, False, None, None)
    for codes, scales, values, signed in ((state[0], state[1], grad, True), (state[2], state[3], grad * grad, False)):
        want_codes, want_scales = quantize(values, signed)
        assert torch.equal(scales, want_scales) and torch.equal(codes, want_codes)


def test_a_skipped_step_changes_nothing():
    n = 4096
    param = torch.randn(n)
    state = zero_state(param)
    found_inf, scale = torch.ones(1), torch.full((1,), 1024.0)
    step = torch.tensor(0.0)
    before = [t.clone() for t in (param, *state)]
    torch.ops.gpuops.adam8_step_([param], [torch.randn(n)], [], *[[t] for t in state], [step], 1e-2, 0.9, 0.999,
                                 1e-8, 0.01, True, False, scale, found_inf)
    assert step.item() == 0 and all(torch.equal(a, b) for a, b in zip(before, (param, *state)))


def mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8))


def train(model, optimizer, steps, seed, scaler=None, overflow_at=()):
    generator = torch.Generator().manual_seed(seed)
    target = torch.nn.Linear(64, 8)
    torch.nn.init.normal_(target.weight, std=0.125, generator=generator)  # targets of variance about 1
    torch.nn.init.zeros_(target.bias)  # (its constructor drew from the global generator)
    losses = []
    for step in range(steps):
        x = torch.randn(32, 64, generator=generator)
        with torch.no_grad():
            y = target(x)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            if step in overflow_at:
                model[0].weight.grad[0, 0] = float("inf")
            scaler.step(optimizer)
            scaler.update()
        losses.append(loss.item())
    return losses


def test_trains_like_torch_adamw_with_a_scaler_and_a_scheduler():
    """A regression MLP (8192 + 1024 weights in 8-bit, biases in float32): the 8-bit run learns as torch's AdamW
    does (final loss within 10% of torch's after 150 steps, both below a fifth of the first); a GradScaler's
    overflow skips the same steps; the moments take about a quarter of float32's bytes."""
    seed = random.randint(0, 2**31)
    ours_model, torch_model = mlp(seed), mlp(seed)
    ours = gpuops.optim.AdamW(ours_model.parameters(), lr=1e-2, state_bits=8)
    theirs = torch.optim.AdamW(torch_model.parameters(), lr=1e-2)
    schedulers = [torch.optim.lr_scheduler.CosineAnnealingLR(o, 150) for o in (ours, theirs)]
    scalers = [gpuops.GradScaler("cpu", init_scale=2.0**10), torch.amp.GradScaler("cpu", init_scale=2.0**10)]
    curves = []
    for model, optimizer, scaler, scheduler in zip((ours_model, torch_model), (ours, theirs), scalers, schedulers):
        losses = []
        for chunk in range(3):
            losses += train(model, optimizer, 50, seed + chunk, scaler, overflow_at=(7,) if chunk == 0 else ())
            for _ in range(50):
                scheduler.step()
        curves.append(losses)
    assert scalers[0].get_scale() == scalers[1].get_scale()
    first, ours_last, torch_last = curves[1][0], curves[0][-1], curves[1][-1]
    assert torch_last < first / 5 and abs(ours_last - torch_last) <= 0.1 * torch_last, (ours_last, torch_last)
    weight_state = ours.state[ours_model[0].weight]
    assert set(weight_state) == {"step", "exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales",
                                 "state_format"}
    assert "exp_avg" in ours.state[ours_model[0].bias]  # 128 elements: float32 moments
    moments = sum(t.numel() * t.element_size() for k, t in weight_state.items() if k.startswith("exp_avg"))
    assert moments / (2 * 4 * ours_model[0].weight.numel()) < 0.26


def test_state_dict_round_trips_and_converts_both_ways():
    """An 8-bit state_dict loads into a fresh 8-bit optimizer bit for bit (the next step too); torch's AdamW
    state loads into an 8-bit one (encoded); dequantized_state_dict() loads into torch's AdamW (decoded)."""
    seed = random.randint(0, 2**31)
    model = mlp(seed)
    opt = gpuops.optim.AdamW(model.parameters(), lr=1e-2, state_bits=8)
    train(model, opt, 3, seed)
    saved = copy.deepcopy(opt.state_dict())  # (as torch.save / torch.load give it: torch's load aliases tensors)
    copy_model = mlp(seed)
    copy_model.load_state_dict(model.state_dict())
    again = gpuops.optim.AdamW(copy_model.parameters(), lr=1e-2, state_bits=8)
    again.load_state_dict(saved)
    for a, b in zip(opt.state.values(), again.state.values()):  # state_format too (torch's load mangles strings)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
                                            for k in a), (a.get("state_format"), b.get("state_format"))
    gpuops.optim.AdamW(mlp(seed).parameters(), lr=1e-2, state_bits=8).load_state_dict(again.state_dict())  # twice
    train(model, opt, 1, seed + 1)
    train(copy_model, again, 1, seed + 1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), copy_model.parameters()))
    # Back to torch's form, and into torch's AdamW.
    plain = opt.dequantized_state_dict()
    assert "exp_avg_codes" in opt.state[model[0].weight]  # the optimizer itself unchanged
    torch_opt = torch.optim.AdamW(mlp(seed).parameters(), lr=1e-2)
    torch_opt.load_state_dict(plain)
    weight_state = torch_opt.state[torch_opt.param_groups[0]["params"][0]]
    state = opt.state[model[0].weight]
    assert torch.equal(weight_state["exp_avg"], torch.ops.gpuops.dequantize_state(
        state["exp_avg_codes"], state["exp_avg_scales"], True))
    # torch's float32 state into an 8-bit optimizer: encoded at its first step, as quantize_state_ encodes it.
    eight = gpuops.optim.AdamW(mlp(seed).parameters(), lr=1e-2, state_bits=8)
    eight.load_state_dict(torch_opt.state_dict())
    eight_weight = eight.param_groups[0]["params"][0]
    eight_weight.grad = torch.zeros_like(eight_weight)
    expected = quantize(weight_state["exp_avg"], True)
    eight._state_tensors(eight_weight, eight.param_groups[0])
    assert torch.equal(eight.state[eight_weight]["exp_avg_codes"], expected[0])


def test_bad_input_is_refused_naming_it():
    params = mlp(0).parameters()
    for bits in (7, 16, True, "8", None):
        with pytest.raises(ValueError, match="state_bits must be 32"):
            gpuops.optim.AdamW(params, state_bits=bits)
    with pytest.raises(ValueError, match="amsgrad=True is not supported with state_bits=8"):
        gpuops.optim.Adam(mlp(0).parameters(), amsgrad=True, state_bits=8)
    model = mlp(1)
    opt = gpuops.optim.AdamW(model.parameters(), state_bits=8)
    train(model, opt, 1, 1)
    before = {k: v.clone() for k, v in opt.state[model[0].weight].items() if isinstance(v, torch.Tensor)}
    for edit, message in (
            (lambda e: e.update(state_format="dynamic8-block64"), "state_format is 'dynamic8-block64'"),
            (lambda e: e.pop("exp_avg_sq_scales"), "exp_avg_sq_scales missing"),
            (lambda e: e.update(exp_avg_codes=e["exp_avg_codes"].float()), "must be a uint8 tensor"),
            (lambda e: e.update(exp_avg_scales=e["exp_avg_scales"][:3]), "must be a float32 tensor of 32"),
            (lambda e: e.update(exp_avg_sq_scales=-e["exp_avg_sq_scales"] - 1), "negative scales"),
            (lambda e: e.update(exp_avg_scales=-e["exp_avg_scales"] - 1), "exp_avg_scales'\\] has negative")):
        saved = opt.state_dict()
        saved["state"] = {k: dict(v) for k, v in saved["state"].items()}
        edit(saved["state"][0])
        with pytest.raises(ValueError, match=message):
            opt.load_state_dict(saved)
        after = opt.state[model[0].weight]
        assert all(torch.equal(after[k], v) for k, v in before.items())
    with pytest.raises(ValueError, match="exp_avg_scales\\[0\\] must be a contiguous 1-d float32 tensor of 16"):
        p = torch.randn(4096)
        torch.ops.gpuops.adam8_step_([p], [p.clone()], [], [torch.zeros(4096, dtype=torch.uint8)], [torch.zeros(3)],
                                     [torch.zeros(4096, dtype=torch.uint8)], [torch.zeros(16)], [torch.zeros(())],
                                     1e-3, 0.9, 0.999, 1e-8, 0.0, True, False, None, None)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_gives_the_cpu_bits(dtype):
    """The same step on the CPU and the GPU: the same bits (the shared element math, no FMA contraction)."""
    generator = torch.Generator().manual_seed(random.randint(0, 2**31))
    n = 70000  # two 65536-element chunks, the last block partial
    master = torch.randn(n, generator=generator)
    state = [*quantize(torch.randn(n, generator=generator) * 0.1, True),
             *quantize(torch.rand(n, generator=generator) * 0.01, False)]
    grad = torch.randn(n, generator=generator).to(dtype)
    results = []
    for device in ("cpu", "cuda"):
        m = master.clone().to(device)
        p = m.to(dtype)
        s = [t.clone().to(device) for t in state]
        masters = [m] if dtype != torch.float32 else []
        for _ in range(3):
            torch.ops.gpuops.adam8_step_([p if masters else m], [grad.to(device)], masters, *[[t] for t in s],
                                         [torch.zeros((), device=device)], 1e-2, 0.9, 0.999, 1e-8, 0.01, True, False,
                                         torch.full((1,), 2.0, device=device), None)
        results.append([t.cpu() for t in (m, p, *s)])
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("device", DEVICES)
def test_16bit_parameters_step_on_masters(device):
    """bfloat16 parameters with 8-bit moments: the parameter is its fp32 master rounded, the master follows
    torch's AdamW on the float32 model within the 8-bit run's own distance."""
    seed = random.randint(0, 2**31)
    model = mlp(seed).to(device=device, dtype=torch.bfloat16)
    opt = gpuops.optim.AdamW(model.parameters(), lr=1e-3, state_bits=8)
    x = torch.randn(16, 64, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()
    state = opt.state[model[0].weight]
    assert "exp_avg_codes" in state and state["master_param"].dtype == torch.float32
    assert torch.equal(model[0].weight, state["master_param"].to(torch.bfloat16))


def test_zero_optimizer_checks_state_bits_and_steps_the_unsharded_bits(world1):
    """ZeroOptimizer(state_bits=8) at one rank steps to the unsharded optimizer's bits (several ranks:
    test_zero_adam8.py); state_bits it does not take are refused naming them."""
    with pytest.raises(TypeError, match="state_bits must be an int"):
        gpuops.ZeroOptimizer(mlp(0).parameters(), stage=1, state_bits="8")
    with pytest.raises(ValueError, match="state_bits must be 32"):
        gpuops.ZeroOptimizer(mlp(0).parameters(), stage=2, state_bits=4)
    with pytest.raises(ValueError, match="amsgrad=true is not supported with state_bits=8"):
        gpuops.ZeroOptimizer(mlp(0).parameters(), stage=1, state_bits=8, amsgrad=True)
    seed = random.randint(0, 2**31)
    models = [mlp(seed), mlp(seed)]
    optimizers = [gpuops.ZeroOptimizer(models[0].parameters(), stage=2, lr=1e-2, state_bits=8),
                  gpuops.optim.AdamW(models[1].parameters(), lr=1e-2, state_bits=8)]
    for model, optimizer in zip(models, optimizers):
        train(model, optimizer, 3, seed)
    assert all(torch.equal(p, q) for p, q in zip(*(m.parameters() for m in models)))


def test_training_state_resumes_an_8bit_run_bit_for_bit(tmp_path):
    """gpuops.TrainingState saves the codes and scales as they are; a resumed run's next steps are the
    uninterrupted run's, bit for bit."""
    seed = random.randint(0, 2**31)
    model = mlp(seed)
    opt = gpuops.optim.AdamW(model.parameters(), lr=1e-2, state_bits=8)
    train(model, opt, 3, seed)
    with gpuops.TrainingState(tmp_path / "state") as state:
        state.save(step=3, model=model, optimizer=opt)
    resumed_model = mlp(seed + 1)  # other weights: the load must replace them
    resumed = gpuops.optim.AdamW(resumed_model.parameters(), lr=1e-2, state_bits=8)
    with gpuops.TrainingState(tmp_path / "state") as state:
        assert state.load(model=resumed_model, optimizer=resumed)["step"] == 3
    train(model, opt, 2, seed + 7)
    train(resumed_model, resumed, 2, seed + 7)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed_model.parameters()))
    assert torch.equal(opt.state[model[0].weight]["exp_avg_codes"],
                       resumed.state[resumed_model[0].weight]["exp_avg_codes"])


def test_a_state_saved_in_another_memory_layout_loads_by_value():
    """Blocks run over memory order: a channels_last weight's codes loaded for a contiguous one are decoded
    (each moment equal to its saved value at its logical position), then encoded in the new layout at the next
    step; an element-wise copy of the codes would have mixed blocks."""
    torch.manual_seed(random.randint(0, 2**31))
    weight = torch.nn.Parameter(torch.randn(8, 16, 8, 8).contiguous(memory_format=torch.channels_last))
    opt = gpuops.optim.AdamW([weight], lr=1e-2, state_bits=8)
    weight.grad = torch.randn_like(weight)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    plain = torch.nn.Parameter(weight.detach().contiguous())
    again = gpuops.optim.AdamW([plain], lr=1e-2, state_bits=8)
    again.load_state_dict(saved)
    decoded = opt.dequantized_state_dict()["state"][0]
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(again.state[plain][name], decoded[name])
    plain.grad = weight.grad.contiguous()
    again.step()
    assert again.state[plain]["exp_avg_codes"].is_contiguous() and "exp_avg" not in again.state[plain]


def test_torchs_edge_semantics_hold_with_8bit_states():
    """As torch's AdamW: a parameter whose .grad is None is not stepped and gets no state; one frozen after a
    step keeps its value and its codes; a strided (non-dense) parameter steps as its dense copy does, bit for
    bit."""
    generator = torch.Generator().manual_seed(random.randint(0, 2**31))
    used, unused = (torch.nn.Parameter(torch.randn(64, 128, generator=generator)) for _ in range(2))
    base = torch.randn(64, 256, generator=generator)
    strided = torch.nn.Parameter(base[:, ::2])  # gaps between its elements: stepped as a dense copy
    dense = torch.nn.Parameter(strided.detach().clone())
    opt = gpuops.optim.AdamW([used, unused, strided], lr=1e-2, state_bits=8)
    reference = gpuops.optim.AdamW([dense], lr=1e-2, state_bits=8)
    before_unused = unused.detach().clone()
    for _ in range(2):
        used.grad = torch.randn(used.shape, generator=generator)
        strided.grad = torch.randn(strided.shape, generator=generator)
        dense.grad = strided.grad.clone()
        opt.step()
        reference.step()
    assert torch.equal(unused, before_unused) and not opt.state.get(unused)
    assert torch.equal(strided, dense) and torch.equal(opt.state[strided]["exp_avg_codes"],
                                                       reference.state[dense]["exp_avg_codes"])
    used.requires_grad_(False)
    used.grad = None
    frozen, codes = used.detach().clone(), opt.state[used]["exp_avg_codes"].clone()
    strided.grad = torch.randn(strided.shape, generator=generator)
    opt.step()
    assert torch.equal(used, frozen) and torch.equal(opt.state[used]["exp_avg_codes"], codes)


@pytest.mark.parametrize("state_bits", [8, 32])
def test_state_memory_per_parameter_under_a_budget(state_bits):
    """What the first step allocates and keeps, counted by gpuops.memory_budget (the allocator's own count, not
    the tensors' sizes): 8-bit moments 2 bytes per element plus two float32 scales per 256, against 8 bytes for
    float32 moments; each tensor's step counter, and the budget's alignment per allocation, stay under 1%."""
    weight = torch.nn.Parameter(torch.randn(1024, 1024))  # 2^20 elements: 4096 blocks
    weight.grad = torch.randn_like(weight)
    optimizer = gpuops.optim.AdamW([weight], lr=1e-3, state_bits=state_bits)
    with gpuops.memory_budget() as budget:
        optimizer.step()
        kept = budget.current_bytes
    per_element = kept / weight.numel()
    expected = 2 + 2 * 4 / 256 if state_bits == 8 else 8
    print(f"state_bits={state_bits}: {kept} bytes kept by the first step, {per_element:.4f} per element")
    assert expected <= per_element <= expected * 1.01, (per_element, expected)
