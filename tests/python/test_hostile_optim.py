"""Hostile input to the Python optimizers, GradScaler and GradAccumulator: the case table the C++ test runs too
(tests/hostile_cases/option_cases.inc: both languages call the same C++ checks, so they must answer alike),
load_state_dict that does not fit, duplicate parameters and non-numbers."""

import copy
import math
import pathlib
import re

import pytest
import torch

import gpuops

TABLE = pathlib.Path(__file__).resolve().parents[1] / "hostile_cases" / "option_cases.inc"
CASES = re.findall(r'^CASE\("([^"]*)", "([^"]*)", "([^"]*)", "([^"]*)"\)', TABLE.read_text(), re.MULTILINE)
INTEGER_OPTIONS = {"growth_interval", "hysteresis", "window"}


def leaf():
    return torch.nn.Parameter(torch.randn(3))


def apply(target, option, text):
    """One case, as tests/cpp/test_hostile_optim.cpp applies it; a refused call must change nothing."""
    # a checkpoint's values are numbers; constructors take ints where the C++ options are int64
    value = int(text) if option in INTEGER_OPTIONS and target != "GradScalerState" else float(text)
    w = leaf()
    if target in ("AdamW", "SGD"):
        kwargs = {option: value}
        if target == "AdamW" and option.startswith("beta"):
            kwargs = {"betas": (value, 0.999) if option == "beta1" else (0.9, value)}
        if option == "dampening":
            kwargs["momentum"] = 0.9
        optimizer = getattr(gpuops.optim, target)([w], **({"lr": 0.1} if target == "SGD" else {}) | kwargs)
        w.grad = torch.randn(3)
        optimizer.step()
        assert torch.isfinite(w).all()
    elif target == "GradScaler":
        scaler = gpuops.GradScaler("cpu", **{option: value})
        assert torch.isfinite(scaler.scale(torch.ones(())))
    elif target == "GradScalerState":
        scaler = gpuops.GradScaler("cpu", init_scale=8.0, growth_interval=3, max_scale=4096.0)
        optimizer = gpuops.optim.SGD([w], lr=0.1)
        scaler.scale(w.sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        before = scaler.state_dict()
        try:
            scaler.load_state_dict(dict(before, **{option: value}))
        except ValueError:
            assert scaler.state_dict() == before, "a refused load changed the scaler"
            raise
        assert scaler.state_dict()[option] == value
        assert torch.isfinite(scaler.scale(torch.ones(())))
    elif target == "GradDivisor":
        scaler = gpuops.GradScaler("cpu")
        optimizer = gpuops.optim.SGD([w], lr=0.1)
        scaler.scale(w.sum()).backward()
        scaler.set_grad_divisor(optimizer, value)
        before = w.detach().clone()
        scaler.step(optimizer)
        torch.testing.assert_close(w.detach(), before - 0.1 / value)
    elif target == "GradAccumulator":
        kwargs = {"window": 2} | {option: value}
        gpuops.GradAccumulator(gpuops.optim.SGD([w], lr=0.1), **kwargs)
    elif target == "AccumulatorCount":
        accumulator = gpuops.GradAccumulator(gpuops.optim.SGD([w], lr=0.1), window=2)
        try:
            accumulator.backward(w.sum(), value)
        except ValueError:
            assert accumulator.micro_batches == 0 and w.grad is None
            raise
        assert accumulator.micro_batches == 1
    else:
        raise AssertionError(f"unknown target {target}")


def test_the_table_is_there():
    assert len(CASES) > 60


@pytest.mark.parametrize("target, option, value, expected", CASES,
                         ids=[f"{t}-{o}-{v}" for t, o, v, _ in CASES])
def test_the_shared_case_table_gets_the_same_answers_in_python(target, option, value, expected):
    if expected:
        with pytest.raises(ValueError) as error:
            apply(target, option, value)
        assert expected in str(error.value)
    else:
        apply(target, option, value)


# ------------------------------------------------------------------------------------- optimizers' load
def stepped_adamw():
    params = [torch.nn.Parameter(torch.randn(2, 3)), torch.nn.Parameter(torch.randn(4))]
    optimizer = gpuops.optim.AdamW(params, lr=0.01)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    return params, optimizer


@pytest.mark.parametrize("spoil, match", [
    (lambda sd: sd["state"].__setitem__(7, copy.deepcopy(sd["state"][0])), "none of the parameter ids"),
    (lambda sd: sd["state"].__setitem__("exp_avg", {}), "none of the parameter ids"),
    (lambda sd: sd["state"][1].__setitem__("step", [1, 2]), r"'step'\] must be one number in \[0, 2\*\*53\]"),
    (lambda sd: sd["state"][1].__setitem__("step", float("nan")), r"'step'\] must be one number in \[0, 2\*\*53\]"),
    (lambda sd: sd["state"][1].__setitem__("step", 1e30), r"'step'\] must be one number in \[0, 2\*\*53\]"),
    (lambda sd: sd["state"][1].__setitem__("exp_avg", torch.zeros(5)), r"has shape \(5,\) but its parameter"),
    (lambda sd: sd["state"][1].__setitem__("exp_avg_sq", "zeros"), "must be a floating tensor"),
    (lambda sd: sd["param_groups"][0].__setitem__("lr", float("inf")), "Invalid learning rate: inf"),
    (lambda sd: sd["param_groups"][0]["params"].pop(), "doesn't match the size of optimizer's group"),
])
def test_a_state_dict_that_does_not_fit_changes_nothing(spoil, match):
    _, source = stepped_adamw()
    params, optimizer = stepped_adamw()
    state_dict = copy.deepcopy(source.state_dict())
    state_dict["param_groups"][0]["lr"] = 0.5
    spoil(state_dict)
    before = copy.deepcopy(optimizer.state_dict())
    with pytest.raises(ValueError, match=match):
        optimizer.load_state_dict(state_dict)
    after = optimizer.state_dict()
    assert after["param_groups"] == before["param_groups"] and optimizer.param_groups[0]["lr"] == 0.01
    for index, entry in before["state"].items():
        for key, value in entry.items():
            assert torch.equal(after["state"][index][key], value)


def test_a_failure_inside_the_load_restores_the_optimizer(monkeypatch):
    params, optimizer = stepped_adamw()
    state_dict = copy.deepcopy(optimizer.state_dict())
    state_dict["param_groups"][0]["lr"] = 0.5
    state, groups = optimizer.state, optimizer.param_groups

    def fail(*args):
        raise RuntimeError("injected")

    monkeypatch.setattr(type(optimizer), "_adapt_loaded_state", fail)
    with pytest.raises(RuntimeError, match="injected"):
        optimizer.load_state_dict(state_dict)
    assert optimizer.state is state and optimizer.param_groups is groups and groups[0]["lr"] == 0.01


# ------------------------------------------------------------------------------------ duplicate parameters
@pytest.mark.parametrize("make", [lambda p: gpuops.optim.AdamW(p, lr=0.1), lambda p: gpuops.optim.SGD(p, lr=0.1)],
                         ids=["adamw", "sgd"])
def test_a_parameter_listed_twice_in_a_group_warns_as_torch_and_steps_once(make):
    p, q = leaf(), leaf()
    with torch.no_grad():
        q.copy_(p)
    with pytest.warns(UserWarning, match="duplicate parameters"):
        twice = make([p, p])
    once = make([q])
    for _ in range(2):
        grad = torch.randn(3)
        p.grad, q.grad = grad.clone(), grad.clone()
        twice.step()
        once.step()
    assert torch.equal(p, q)


def test_a_parameter_in_two_groups_is_torchs_error_and_a_hand_edited_one_is_caught_at_the_step():
    p, q = leaf(), leaf()
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        gpuops.optim.AdamW([{"params": [p]}, {"params": [q, p]}])
    optimizer = gpuops.optim.AdamW([{"params": [p]}, {"params": [q]}])
    optimizer.param_groups[1]["params"].append(p)
    p.grad, q.grad = torch.randn(3), torch.randn(3)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="more than one parameter group"):
        optimizer.step()
    assert torch.equal(p, before) and len(optimizer.state) == 0


# --------------------------------------------------------------------------------------- scaler and types
def test_the_scaler_load_from_the_issue_changes_nothing():
    scaler = gpuops.GradScaler("cpu", init_scale=64.0)
    w = leaf()
    optimizer = gpuops.optim.SGD([w], lr=0.1)
    scaler.scale(w.sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    before = scaler.state_dict()
    for changes in (dict(scale=2.0, growth_factor=3.0, _skipped_steps=10**30),
                    dict(scale=2.0, growth_factor=3.0, _growth_tracker=2**31)):
        with pytest.raises(ValueError, match="Invalid _(skipped_steps|growth_tracker) value"):
            scaler.load_state_dict(dict(before, **changes))
        assert scaler.state_dict() == before and scaler.get_growth_factor() == 2.0


def test_setters_and_update_refuse_what_the_constructor_refuses():
    scaler = gpuops.GradScaler("cpu")
    for setter, value in ((scaler.set_growth_factor, float("nan")), (scaler.set_backoff_factor, 1.5),
                          (scaler.set_growth_interval, 0)):
        with pytest.raises(ValueError, match="GradScaler.set_"):
            setter(value)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (2.0, 0.5, 2000)
    w = leaf()
    scaler.scale(w.sum()).backward()
    scaler.step(gpuops.optim.SGD([w], lr=0.1))
    with pytest.raises(ValueError, match="Invalid new_scale value: nan"):
        scaler.update(float("nan"))


@pytest.mark.parametrize("call, error, match", [
    (lambda: gpuops.optim.AdamW([leaf()], lr="0.1"), TypeError, "AdamW: lr must be a real number, got '0.1'"),
    (lambda: gpuops.optim.AdamW([leaf()], betas=0.9), TypeError, "betas must be a pair of numbers"),
    (lambda: gpuops.optim.SGD([leaf()], lr=0.1, momentum=None), TypeError, "momentum must be a real number"),
    (lambda: gpuops.GradScaler("cpu", growth_interval=2.5), TypeError, "growth_interval must be an int"),
    (lambda: gpuops.GradScaler("cpu", growth_interval=2**70), ValueError, "Invalid growth_interval value"),
    (lambda: gpuops.GradScaler("cpu").load_state_dict([1]), TypeError, "state_dict must be a dict"),
    (lambda: gpuops.GradAccumulator(gpuops.optim.SGD([leaf()], lr=0.1), window=True), TypeError, "window must be an int"),
    (lambda: gpuops.GradAccumulator(gpuops.optim.SGD([leaf()], lr=0.1), window=1.0), TypeError, "window must be an int"),
])
def test_non_numbers_are_type_errors_naming_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("loss, count, error, match", [
    (lambda w: 3.0, 1, TypeError, "loss_sum must be a torch.Tensor"),
    (lambda w: w.detach().sum(), 1, ValueError, "loss_sum does not require grad"),
    (lambda w: w * 2, 1, ValueError, "loss_sum must be one floating value"),
    (lambda w: w.sum(), "3", TypeError, "count must be a real number"),
    (lambda w: w.sum(), None, TypeError, "count must be a real number"),
    (lambda w: w.sum(), torch.tensor([1.0, 2.0]), ValueError, "count must be one number"),
    (lambda w: w.sum(), torch.tensor(True), ValueError, "count must be a real number, got a Bool tensor"),
    (lambda w: w.sum(), torch.tensor(2.0, device="meta"), ValueError, "count is on meta but must be on the CPU or on cpu"),
])
def test_hostile_micro_batches_are_refused_and_change_nothing(loss, count, error, match):
    w = leaf()
    accumulator = gpuops.GradAccumulator(gpuops.optim.SGD([w], lr=0.1), window=2)
    with pytest.raises(error, match=match):
        accumulator.backward(loss(w), count)
    assert accumulator.micro_batches == 0 and w.grad is None
    accumulator.backward(w.sum(), 2)  # still usable
    assert accumulator.micro_batches == 1 and not math.isnan(float(w.grad.sum()))
