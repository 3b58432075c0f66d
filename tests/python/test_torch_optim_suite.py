"""PyTorch's own optimizer test data run against our drop-ins gpuops.optim.Adam / AdamW / SGD.

The inputs come from the installed wheel's helpers (torch.testing._internal.common_optimizers.optim_db: for
each optimizer, the keyword arguments torch tests with and the bad inputs with the exact error type and message
torch expects), so a new torch brings its new cases. The checks of the most important TestOptimRenewed test
bodies (pytorch/test/test_optim.py) are carried over in our own words, each naming its origin.
"""

import copy
import inspect
import random

import pytest
import torch
from torch.testing._internal.common_optimizers import OptimizerErrorEnum, optim_db

import gpuops

from conftest import DEVICES

NAMES = ["Adam", "AdamW", "SGD"]
INFO = {info.name: info for info in optim_db if info.name in NAMES}
# torch's keyword arguments that pick one of torch's implementations; every one steps alike in ours
IMPL_FLAGS = ("foreach", "fused", "capturable", "differentiable")


def ours(name):
    return getattr(gpuops.optim, name)


def theirs(name):
    return getattr(torch.optim, name)


def model_and_copy(dtype, device, seed):
    """A small model (two layers, one group each) and a copy with the same values."""
    generator = torch.Generator().manual_seed(seed)
    first = [torch.randn(s, dtype=dtype, generator=generator) for s in [(5, 4), (5,)]]
    second = [torch.randn(s, dtype=dtype, generator=generator) for s in [(3, 5), (3,)]]

    def make():
        return ([torch.nn.Parameter(p.clone().to(device)) for p in first],
                [torch.nn.Parameter(p.clone().to(device)) for p in second])
    return make(), make()


def loss_of(layers, x):
    (w1, b1), (w2, b2) = layers
    return (torch.tanh(x @ w1.T + b1) @ w2.T + b2).pow(2).sum()


def run_both(name, kwargs, dtype, device, steps=5, group_lr=None, torch_kwargs=None, seed=None):
    """Steps ours and torch's (foreach=False: the for-loop reference) side by side on fresh random inputs;
    returns both optimizers and parameter lists."""
    seed = random.randrange(2**31) if seed is None else seed
    (a1, a2), (b1, b2) = model_and_copy(dtype, device, seed)
    second = {} if group_lr is None else {"lr": group_lr}
    mine = ours(name)([{"params": a1}, {"params": a2, **second}], **kwargs)
    reference = theirs(name)([{"params": b1}, {"params": b2, **second}],
                             **(torch_kwargs or {**kwargs, "foreach": False}))
    generator = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        x = torch.randn(8, 4, dtype=dtype, generator=generator).to(device)
        for optimizer, layers in ((mine, (a1, a2)), (reference, (b1, b2))):
            optimizer.zero_grad()
            loss_of(layers, x).backward()
            optimizer.step()
    return (mine, a1 + a2), (reference, b1 + b2), seed


# assert_close's defaults (rtol, atol) per dtype, which state_tolerance widens.
DEFAULT_TOLERANCES = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float32: (1.3e-6, 1e-5),
                      torch.float64: (1e-7, 1e-7), torch.complex64: (1.3e-6, 1e-5), torch.complex128: (1e-7, 1e-7)}


def state_tolerance(want, tolerance):
    """A state that sums gradients (a momentum buffer) can cancel far below its terms: a few ulps of the largest
    element (64 eps of it) on top of the tolerance, which a parameter one ulp apart earlier steps can reach."""
    rtol, atol = (tolerance["rtol"], tolerance["atol"]) if tolerance else DEFAULT_TOLERANCES[want.dtype]
    scale = want.abs().max().item() if want.numel() else 0.0
    return dict(rtol=rtol, atol=max(atol, 64 * torch.finfo(want.abs().dtype).eps * scale))


def assert_same_state(mine, reference, seed, **tolerance):
    """Parameters and every state tensor the two optimizers share, within their dtype's rounding (or the
    `tolerance` given: rtol and atol; for states at the state's own scale too, state_tolerance)."""
    for p, q in zip((p for g in mine.param_groups for p in g["params"]),
                    (q for g in reference.param_groups for q in g["params"])):
        torch.testing.assert_close(p, q, msg=lambda m: f"seed {seed}: parameter: {m}", **tolerance)
        for key in set(mine.state[p]) & set(reference.state[q]):
            got, want = mine.state[p][key], reference.state[q][key]
            if key == "step":  # torch's SGD keeps a loaded step as it is; ours counts
                if "momentum" not in mine.defaults:
                    assert float(got) == float(want), f"seed {seed}: step {float(got)} != {float(want)}"
            else:
                torch.testing.assert_close(got, want, msg=lambda m: f"seed {seed}: state {key!r}: {m}",
                                           **state_tolerance(want, tolerance))


# ---- constructor surface -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_signature_is_torchs(name):
    """Every keyword torch's constructor takes, in its order, kind and default (foreach=, fused=, capturable=,
    differentiable=, decoupled_weight_decay= were refused before); then ours: Adam's and AdamW's state_bits."""
    def shape(cls):
        return [(p.name, p.kind, p.default) for p in inspect.signature(cls).parameters.values()]
    extra = [("state_bits", inspect.Parameter.KEYWORD_ONLY, 32)] if name in ("Adam", "AdamW") else []
    assert shape(ours(name)) == shape(theirs(name)) + extra


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("device", DEVICES)
def test_error_inputs_raise_what_torch_raises(name, device):
    """Origin: TestOptimRenewed.test_errors. Each of optim_db's bad inputs raises torch's error type with a
    message matching torch's regex, in ours as in torch's (checked too, so the data holds for this wheel)."""
    inputs = INFO[name].optim_error_inputs_func(device=device, dtype=torch.float32)
    if not inputs:  # torch's data has no CUDA error inputs for SGD (its checks are device-independent)
        pytest.skip(f"optim_db has no error inputs for {name} on {device}")
    for cls in (theirs(name), ours(name)):
        for error_input in inputs:
            optim_input = error_input.optimizer_error_input
            params = optim_input.params
            if params is None:
                params = [torch.nn.Parameter(torch.randn(2, 2, device=device))]
            expect = pytest.warns if issubclass(error_input.error_type, Warning) else pytest.raises
            if error_input.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR:
                with expect(error_input.error_type, match=error_input.error_regex):
                    cls(params, **optim_input.kwargs)
            else:
                optimizer = cls(params, **optim_input.kwargs)
                with expect(error_input.error_type, match=error_input.error_regex):
                    optimizer.step()


@pytest.mark.parametrize("name", NAMES)
def test_differentiable_true_is_refused_naming_it(name):
    with pytest.raises(ValueError, match=f"{name}: differentiable=True is not supported"):
        ours(name)([torch.nn.Parameter(torch.randn(3))], differentiable=True)


@pytest.mark.parametrize("name", NAMES)
def test_implementation_flags_are_kept_and_step_alike(name):
    """foreach / fused / capturable choose among torch's implementations; ours has one, so every accepted value
    gives the same step, and param_groups keep what the caller gave (as torch's do)."""
    results, seed = [], random.randrange(2**31)
    for flags in [{}, {"foreach": True}, {"foreach": False}, {"fused": True}, {"fused": False},
                  *([{"capturable": True}, {"capturable": False}] if name != "SGD" else [])]:
        (mine, params), _, _ = run_both(name, {"lr": 0.01, **flags}, torch.float32, "cpu", steps=2,
                                        torch_kwargs={"lr": 0.01, "foreach": False}, seed=seed)
        for key, value in flags.items():
            assert all(g[key] == value for g in mine.param_groups)
        results.append(torch.cat([p.detach().flatten() for p in params]))
    for other in results[1:]:
        assert torch.equal(other, results[0])


def test_adam_decoupled_weight_decay_is_adamw():
    """torch's Adam(decoupled_weight_decay=True) is AdamW; ours too."""
    (mine, _), (reference, _), seed = run_both(
        "Adam", {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True}, torch.float32, "cpu",
        torch_kwargs={"lr": 0.01, "weight_decay": 0.1, "foreach": False})
    with pytest.raises(AssertionError):  # torch's Adam without the flag differs...
        assert_same_state(mine, reference, seed)
    (mine, _), (reference, _), seed = run_both(
        "Adam", {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True}, torch.float32, "cpu")
    assert_same_state(mine, reference, seed)  # ...torch's Adam with it agrees


# ---- numerics over optim_db's inputs ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("device", DEVICES)
def test_optim_inputs_match_torch(name, dtype, device):
    """Origin: TestOptimRenewed.test_foreach_matches_forloop / test_fused_matches_forloop. For every keyword set
    optim_db tests torch with, 5 steps of ours match torch's for-loop implementation within rounding (float64
    parameters step on torch's fused kernels, float32 ones on ours). A float32 tensor lr or betas (CUDA's inputs
    have them) makes torch's for-loop compute its step size in float32 (lr / bias_correction is a float32
    tensor), where the fused kernels compute it in float64: float64 parameters then agree to float32's rounding
    (found on the first GPU run: 1.4e-7 relative, over float64's 1e-7 tolerance)."""
    inputs = INFO[name].optim_inputs_func(device=device, dtype=dtype)
    assert inputs
    for optim_input in inputs:
        (mine, _), (reference, _), seed = run_both(name, optim_input.kwargs, dtype, device, group_lr=0.005)
        tensor_scalars = any(isinstance(v, torch.Tensor) for value in optim_input.kwargs.values()
                             for v in (value if isinstance(value, tuple) else (value,)))
        float32_step = dict(rtol=1.3e-6, atol=1e-5) if tensor_scalars and dtype == torch.float64 else {}
        assert_same_state(mine, reference, seed, **float32_step)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_matches_torch_and_the_real_view(name, dtype):
    """Origin: TestOptimRenewed.test_complex. A complex parameter steps as torch steps it: as its real view."""
    kwargs = {"lr": 0.01, "weight_decay": 0.1, **({"amsgrad": True} if name != "SGD" else {"momentum": 0.9})}
    start = torch.randn(4, 3, dtype=dtype)
    complex_param, torch_param = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    real_param = torch.nn.Parameter(torch.view_as_real(start).clone())
    optimizers = [ours(name)([complex_param], **kwargs), theirs(name)([torch_param], foreach=False, **kwargs),
                  ours(name)([real_param], **kwargs)]
    for _ in range(4):
        grad = torch.randn(4, 3, dtype=dtype)
        complex_param.grad, torch_param.grad, real_param.grad = grad.clone(), grad.clone(), torch.view_as_real(grad)
        for optimizer in optimizers:
            optimizer.step()
    torch.testing.assert_close(complex_param, torch_param)
    torch.testing.assert_close(torch.view_as_real(complex_param), real_param, rtol=0, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_tensor_lr_in_a_param_group(name):
    """Origin: TestOptimRenewed.test_param_groups_lr. A group's lr given as a tensor steps as torch's does
    and the loss goes down."""
    (mine, params), (reference, _), seed = run_both(name, {"lr": torch.tensor(0.01)}, torch.float32, "cpu",
                                                    steps=10, group_lr=torch.tensor(0.02))
    assert_same_state(mine, reference, seed)
    x = torch.randn(8, 4)
    before = loss_of(model_and_copy(torch.float32, "cpu", seed)[0], x)
    assert loss_of((params[:2], params[2:]), x) < before


# ---- TestOptimRenewed bodies ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_step_is_noop_when_params_have_no_grad(name):
    """Origin: TestOptimRenewed.test_step_is_noop_when_params_have_no_grad. Parameters without a gradient (also
    frozen ones, requires_grad=False) are neither changed nor given state; an empty parameter steps."""
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4), requires_grad=False)]
    empty = torch.nn.Parameter(torch.randn(0, 3))
    empty.grad = torch.zeros(0, 3)
    before = [p.detach().clone() for p in params]
    optimizer = ours(name)([*params, empty], lr=0.1, weight_decay=0.1)
    for _ in range(3):
        optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert all(p not in optimizer.state for p in params)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(name, set_to_none):
    """Origin: TestOptimRenewed.test_zero_grad (Optimizer's): None, or zeros in place."""
    param = torch.nn.Parameter(torch.randn(3))
    param.grad = torch.randn(3)
    grad = param.grad
    ours(name)([param], lr=0.1).zero_grad(set_to_none=set_to_none)
    assert param.grad is None if set_to_none else (param.grad is grad and not grad.any())


@pytest.mark.parametrize("name", NAMES)
def test_step_hooks(name):
    """Origin: TestOptimRenewed.test_step_pre_hook / test_step_post_hook / test_step_all_hooks: the hooks are
    Optimizer's and run around our step, in registration order, and a removed hook no longer runs."""
    param = torch.nn.Parameter(torch.randn(3))
    param.grad = torch.randn(3)
    optimizer = ours(name)([param], lr=0.1)
    calls = []
    pre = optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append(("pre", opt)))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append(("post", param.detach().clone())))
    before = param.detach().clone()
    optimizer.step()
    assert len(calls) == 2 and calls[0] == ("pre", optimizer)
    assert torch.equal(calls[1][1], param) and not torch.equal(param, before)  # post runs after the update
    pre.remove()
    optimizer.step()
    assert [kind for kind, _ in calls] == ["pre", "post", "post"]


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trips_with_torch_both_ways(name):
    """Origin: TestOptimRenewed.test_state_dict_deterministic / test_state_dict_with_cuda_params: state saved
    after 3 steps and loaded into a fresh optimizer continues exactly. Here across libraries: torch's state
    into ours and ours into torch's, each pair then staying within rounding for 3 more steps."""
    kwargs = {"lr": 0.01, "weight_decay": 0.1, **({"amsgrad": True} if name != "SGD" else {"momentum": 0.9})}
    seed = random.randrange(2**31)
    for source, target in ((theirs(name), ours(name)), (ours(name), theirs(name))):
        (a1, a2), (b1, b2) = model_and_copy(torch.float32, "cpu", seed)
        first = source([{"params": a1}, {"params": a2}], **kwargs)
        generator = torch.Generator().manual_seed(seed)
        xs = [torch.randn(8, 4, generator=generator) for _ in range(6)]
        for x in xs[:3]:
            first.zero_grad()
            loss_of((a1, a2), x).backward()
            first.step()
        with torch.no_grad():
            for p, q in zip(b1 + b2, a1 + a2):
                p.copy_(q)
        second = target([{"params": b1}, {"params": b2}], **kwargs)
        second.load_state_dict(copy.deepcopy(first.state_dict()))
        for x in xs[3:]:
            for optimizer, layers in ((first, (a1, a2)), (second, (b1, b2))):
                optimizer.zero_grad()
                loss_of(layers, x).backward()
                optimizer.step()
        assert_same_state(second, first, seed)


@pytest.mark.parametrize("name", NAMES)
def test_can_load_older_state_dict(name):
    """Origin: TestOptimRenewed.test_can_load_older_state_dict. A state_dict from before the newer flags
    (optim_db's not_og_supported_flags dropped from param_groups, integer steps) loads and steps as torch's."""
    kwargs = {"lr": 0.01, **({} if name != "SGD" else {"momentum": 0.9})}
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    old = theirs(name)(params, foreach=False, **kwargs)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        old.step()
    state_dict = copy.deepcopy(old.state_dict())
    for group in state_dict["param_groups"]:
        for flag in (*INFO[name].not_og_supported_flags, "fused", "decoupled_weight_decay"):
            group.pop(flag, None)
    for entry in state_dict["state"].values():
        if "step" in entry:
            entry["step"] = int(entry["step"])
    copies = [[torch.nn.Parameter(p.detach().clone()) for p in params] for _ in range(2)]
    mine, reference = ours(name)(copies[0], **kwargs), theirs(name)(copies[1], foreach=False, **kwargs)
    mine.load_state_dict(copy.deepcopy(state_dict))
    reference.load_state_dict(state_dict)
    assert mine.param_groups[0]["maximize"] is False and mine.param_groups[0]["foreach"] is None
    grads = [torch.randn_like(p) for p in params]
    for optimizer, ps in ((mine, copies[0]), (reference, copies[1])):
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        optimizer.step()
    assert_same_state(mine, reference, 0)


@pytest.mark.parametrize("name", NAMES)
def test_deepcopy_copies_all_public_attrs(name):
    """Origin: TestOptimRenewed.test_deepcopy_copies_all_public_attrs."""
    params = [torch.nn.Parameter(torch.randn(3, 2))]
    optimizer = ours(name)(params, lr=0.1)
    for _ in range(3):
        params[0].grad = torch.randn(3, 2)
        optimizer.step()

    def public(obj):
        return {key for key in obj.__dict__ if not key.startswith("_")}
    duplicate = copy.deepcopy(optimizer)
    assert public(duplicate) == public(optimizer)
    assert duplicate._step_supports_amp_scaling  # the AMP hand-off survives the copy


@pytest.mark.parametrize("name", NAMES)
def test_float64_parameters_follow_the_scaler(name):
    """float64 parameters (torch's fused kernels) take the GradScaler hand-off as float32 ones do: divided by
    the scale when finite, skipped (and the step not counted) on overflow. torch's scaler: ours refuses float64
    gradients (its unscale pass takes float32 and 16-bit ones)."""
    param = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    reference = torch.nn.Parameter(param.detach().clone())
    mine, theirs_ = ours(name)([param], lr=0.1), theirs(name)([reference], lr=0.1, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for overflow in (False, True, False):
        grad = torch.randn(5, dtype=torch.float64)
        before = param.detach().clone()
        scaler.scale((param * (grad if not overflow else grad * float("inf"))).sum()).backward()
        scaler.step(mine)
        scaler.update()
        mine.zero_grad()
        if overflow:
            assert torch.equal(param, before)
        else:
            reference.grad = grad
            theirs_.step()
        torch.testing.assert_close(param, reference)
    if name != "SGD":
        assert float(mine.state[param]["step"]) == 2.0


@pytest.mark.parametrize("name", NAMES)
def test_gradients_stay_scaled_after_a_scaled_step(name):
    """An intended difference from torch, decided in issue 11: after scaler.step(), torch's optimizers leave
    .grad unscaled; ours divide each gradient as they read it and leave .grad as backward() wrote it (writing
    it back unscaled would be an extra pass over the gradients). scaler.unscale_() first unscales it, as in
    torch."""
    for unscale_first in (False, True):
        param = torch.nn.Parameter(torch.randn(4))
        scaler = gpuops.GradScaler("cpu", init_scale=1024.0)
        optimizer = ours(name)([param], lr=0.1)
        scaler.scale((param * torch.arange(4.0)).sum()).backward()
        if unscale_first:
            scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        assert torch.equal(param.grad, torch.arange(4.0) * (1.0 if unscale_first else 1024.0))


# ---- layouts and sparse gradients (torch's test_forloop_goes_right_direction with contiguous=False,
# test_rosenbrock_sparse, test_state_dict_deterministic across the two libraries) ------------------------------

VIEWS = {"every other column": (lambda t: t[..., ::2], (10, 2)),
         "every other row of the transpose": (lambda t: t.t()[::2], (2, 10))}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64, torch.bfloat16])
@pytest.mark.parametrize("view", VIEWS)
def test_strided_parameters_and_gradients_step_as_torchs(name, dtype, view):
    """A parameter that is a strided view (not one dense block) and a gradient laid out otherwise than its
    parameter: torch steps both; ours steps a dense copy and writes it back (bf16: on its fp32 master, against
    torch's fp32 step from the same values)."""
    # weight_decay a power of two: wd * p is exact, so torch's fused multiply-add and our plain one round g + wd*p
    # alike (bf16 inputs can make it cancel to exactly 0 in one and 1e-9 in the other, which Adam then amplifies).
    kwargs = {"lr": 0.05, "weight_decay": 0.125, **({"amsgrad": True} if name != "SGD" else
                                                  {"momentum": 0.9, "nesterov": True})}
    take, strides = VIEWS[view]
    base = torch.randn(10, 10, dtype=dtype)
    mine = torch.nn.Parameter(take(base.clone()))
    reference = torch.nn.Parameter(take(base.clone() if dtype != torch.bfloat16 else base.float()))
    assert mine.stride() == strides
    opt, ref = ours(name)([mine], **kwargs), theirs(name)([reference], foreach=False, **kwargs)
    for step in range(6):
        grad = torch.randn(*mine.shape, dtype=dtype)
        reference.grad = grad.clone().to(reference.dtype)
        mine.grad = grad.t().contiguous().t() if step % 2 else grad.clone()  # another layout every other step
        ref.step()
        opt.step()
    assert mine.stride() == strides  # still the user's view
    if dtype == torch.bfloat16:
        torch.testing.assert_close(opt.state[mine]["master_param"], reference, rtol=1e-5, atol=1e-6)
        # the bf16 parameter is its master rounded (the master and torch's fp32 parameter, a few ulps apart, can
        # straddle a bf16 rounding boundary)
        assert torch.equal(mine, opt.state[mine]["master_param"].to(torch.bfloat16))
        assert len(opt.__dict__["_master_versions"]) == 1  # the stepped copies are not remembered
        return
    torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.state_dict()["state"], ref.state_dict()["state"], rtol=1e-5, atol=1e-6)


def test_state_torch_laid_out_otherwise_is_continued():
    """torch's SGD momentum buffer takes its first gradient's layout (contiguous, for a transposed parameter):
    loaded into ours it is laid out as our state and continued."""
    base = torch.randn(6, 4)
    theirs, mine = (torch.nn.Parameter(base.clone().t()) for _ in range(2))
    opt_t = torch.optim.SGD([theirs], lr=0.1, momentum=0.9, foreach=False)
    theirs.grad = torch.randn(4, 6)
    opt_t.step()
    assert opt_t.state[theirs]["momentum_buffer"].stride() != theirs.stride()
    with torch.no_grad():
        mine.copy_(theirs)
    opt = gpuops.optim.SGD([mine], lr=0.1, momentum=0.9)
    opt.load_state_dict(copy.deepcopy(opt_t.state_dict()))
    for _ in range(3):
        grad = torch.randn(4, 6)
        theirs.grad, mine.grad = grad.clone(), grad.clone()
        opt_t.step()
        opt.step()
    torch.testing.assert_close(mine, theirs)
    torch.testing.assert_close(opt.state_dict(), opt_t.state_dict())
    assert copy.deepcopy(opt).state_dict()["state"][0].keys() == {"momentum_buffer"}  # a copy keeps torch's form


@pytest.mark.parametrize("kwargs", [{"lr": 0.02}, {"lr": 0.02, "momentum": 0.9}, {"lr": 0.02, "momentum": 0.9,
                                    "dampening": 0.3, "maximize": True}, {"lr": 0.02, "momentum": 0.5,
                                                                          "nesterov": True}])
def test_sparse_gradients_step_as_torchs_sgd(kwargs):
    """Origin: test_rosenbrock_sparse. An Embedding(sparse=True) beside a dense layer, SGD side by side with
    torch's; the state dicts equal. Adam and AdamW still refuse a sparse gradient (torch's too)."""
    torch.manual_seed(random.randrange(2**31))
    models = [torch.nn.ModuleDict({"emb": torch.nn.Embedding(30, 4, sparse=True), "out": torch.nn.Linear(4, 2)})]
    models.append(copy.deepcopy(models[0]))
    optimizers = [gpuops.optim.SGD(models[0].parameters(), foreach=False, **kwargs),
                  torch.optim.SGD(models[1].parameters(), foreach=False, **kwargs)]
    for _ in range(5):
        index = torch.randint(0, 30, (7,))
        for model, optimizer in zip(models, optimizers):
            optimizer.zero_grad()
            model["out"](model["emb"](index)).square().sum().backward()
            optimizer.step()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)  # the dense layer: fused against for-loop rounding
    torch.testing.assert_close(optimizers[0].state_dict(), optimizers[1].state_dict(), rtol=1e-5, atol=1e-5)
    embedding = torch.nn.Embedding(5, 2, sparse=True)
    embedding(torch.tensor([1])).sum().backward()
    with pytest.raises(ValueError, match="sparse gradient"):
        gpuops.optim.AdamW(embedding.parameters()).step()
    # torch's SGD fails mid-step on a sparse gradient with weight decay; ours refuses it before any parameter
    # (the dense one listed first here) has moved
    dense = torch.nn.Parameter(torch.randn(3))
    dense.grad = torch.randn(3)
    before = dense.detach().clone()
    with pytest.raises(ValueError, match="sparse gradient and weight_decay 0.1"):
        gpuops.optim.SGD([dense, *embedding.parameters()], lr=0.1, weight_decay=0.1).step()
    assert torch.equal(dense, before)


def test_sparse_gradients_follow_the_scaler_and_skip_on_overflow():
    """Under a GradScaler the sparse step divides by the scale and is skipped on an inf, as torch's scaler
    makes torch's SGD do (the dense parameters take the sync-free path)."""
    models = [torch.nn.Embedding(12, 3, sparse=True)]
    models.append(copy.deepcopy(models[0]))
    optimizers = [gpuops.optim.SGD(models[0].parameters(), lr=0.1, momentum=0.9),
                  torch.optim.SGD(models[1].parameters(), lr=0.1, momentum=0.9)]
    scalers = [gpuops.GradScaler("cpu", init_scale=1024.0), torch.amp.GradScaler("cpu", init_scale=1024.0)]
    for step in range(4):
        index = torch.randint(0, 12, (5,))
        for model, optimizer, scaler in zip(models, optimizers, scalers):
            optimizer.zero_grad()
            loss = model(index).square().sum() * (float("inf") if step == 1 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    assert scalers[0].get_scale() == scalers[1].get_scale() == 512.0 * 2 ** 0
    torch.testing.assert_close(models[0].weight, models[1].weight)


@pytest.mark.parametrize("kwargs", [{"lr": 0.01}, {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.01}])
def test_sgd_state_dict_is_torchs_and_cross_loads_both_ways(kwargs):
    """torch's SGD keeps a momentum_buffer and nothing else (no entry without momentum): ours shows the same
    state_dict, so each loads the other's and the two then step alike and save equal state dicts."""
    seed = random.randrange(2**31)
    for first_cls, second_cls in ((ours("SGD"), theirs("SGD")), (theirs("SGD"), ours("SGD"))):
        (a1, a2), (b1, b2) = model_and_copy(torch.float32, "cpu", seed)
        first = first_cls([{"params": a1}, {"params": a2}], **kwargs)
        reference = (second_cls if first_cls is ours("SGD") else first_cls)
        twin = reference([{"params": b1}, {"params": b2}], **kwargs)
        generator = torch.Generator().manual_seed(seed)
        xs = [torch.randn(8, 4, generator=generator) for _ in range(6)]
        for x in xs[:3]:
            for optimizer, layers in ((first, (a1, a2)), (twin, (b1, b2))):
                optimizer.zero_grad()
                loss_of(layers, x).backward()
                optimizer.step()
        # the same form from both libraries (values within the fused step's rounding)
        torch.testing.assert_close(first.state_dict(), twin.state_dict(), rtol=1e-5, atol=1e-5)
        (c1, c2), _ = model_and_copy(torch.float32, "cpu", seed)
        with torch.no_grad():
            for p, q in zip(c1 + c2, a1 + a2):
                p.copy_(q)
        second = second_cls([{"params": c1}, {"params": c2}], **kwargs)
        second.load_state_dict(copy.deepcopy(first.state_dict()))
        for x in xs[3:]:
            for optimizer, layers in ((first, (a1, a2)), (second, (c1, c2))):
                optimizer.zero_grad()
                loss_of(layers, x).backward()
                optimizer.step()
        torch.testing.assert_close(first.state_dict(), second.state_dict(), rtol=1e-5, atol=1e-5)
        for p, q in zip(a1 + a2, c1 + c2):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
