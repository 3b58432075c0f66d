"""Careless and hostile input to every public Python entry point that the other hostile suites do not cover
(memory_budget, device_info, FlatParams, MemoryProfile, the checkpoint policies, clip_grad_norm_, GradScaler's
loop methods, GradAccumulator, the batch-size search's helpers): a typed error naming the argument (never
pybind11's signature dump or a bare AttributeError), and a refused call changes nothing."""

import pytest
import torch

import gpuops
from gpuops.batch_size import analytic_profile, cache_key, model_signature
from gpuops.checkpointing import LayerCost, choose_for_budget

NAN = float("nan")
HUGE = 2**70


def param(*shape):
    return torch.nn.Parameter(torch.randn(*shape))


def profile():
    return gpuops._C.fit_memory_profile([(1, 100), (2, 150)])


def shard(flat, rank, world):
    return gpuops.FlatParams.shard(flat, rank, world)


# (label, call, error type, text the message must hold: the argument's name)
ARGUMENT_CASES = [
    ("budget limit float", lambda: gpuops.memory_budget(1.5), TypeError, "limit_bytes"),
    ("budget limit str", lambda: gpuops.memory_budget("10"), TypeError, "limit_bytes"),
    ("budget limit nan", lambda: gpuops.memory_budget(NAN), TypeError, "limit_bytes"),
    ("budget limit bool", lambda: gpuops.memory_budget(True), TypeError, "limit_bytes"),
    ("budget limit 2**70", lambda: gpuops.memory_budget(HUGE), ValueError, "limit_bytes"),
    ("budget limit -1", lambda: gpuops.memory_budget(-1), ValueError, "limit_bytes"),  # was "no limit"
    ("budget limit 0", lambda: gpuops.memory_budget(0), ValueError, "limit_bytes"),
    ("budget device", lambda: gpuops.memory_budget(10, "gpu"), ValueError, "device"),
    ("device_info str", lambda: gpuops.device_info("0"), TypeError, "index"),
    ("device_info float", lambda: gpuops.device_info(1.5), TypeError, "index"),
    ("device_info 2**70", lambda: gpuops.device_info(HUGE), ValueError, "index"),
    ("FlatParams None", lambda: gpuops.FlatParams(None), TypeError, "params"),
    ("FlatParams one tensor", lambda: gpuops.FlatParams(param(3)), TypeError, "params"),
    ("FlatParams ints", lambda: gpuops.FlatParams([1, 2]), TypeError, "params[0]"),
    ("FlatParams alignment float", lambda: gpuops.FlatParams([param(3)], alignment_bytes=1.5), TypeError,
     "alignment_bytes"),
    ("FlatParams alignment None", lambda: gpuops.FlatParams([param(3)], alignment_bytes=None), TypeError,
     "alignment_bytes"),
    ("FlatParams alignment 2**70", lambda: gpuops.FlatParams([param(3)], alignment_bytes=HUGE), ValueError,
     "alignment_bytes"),
    ("FlatParams world 2**70", lambda: gpuops.FlatParams([param(3)], world_size=HUGE), ValueError, "world_size"),
    ("shard None", lambda: shard(None, 0, 1), TypeError, "flat"),
    ("shard 2-D", lambda: shard(torch.zeros(2, 4), 0, 2), ValueError, "flat"),
    ("shard world 2**70", lambda: shard(torch.zeros(8), 0, HUGE), ValueError, "world_size"),
    ("shard rank", lambda: shard(torch.zeros(8), 2, 2), ValueError, "rank"),
    ("predict 2**70", lambda: profile().predict(HUGE), ValueError, "batch"),
    ("predict nan", lambda: profile().predict(NAN), TypeError, "batch"),
    ("max_batch_for 2**70", lambda: profile().max_batch_for(HUGE), ValueError, "bytes"),
    ("fit tolerance str", lambda: gpuops._C.fit_memory_profile([(1, 1), (2, 2)], "1"), TypeError, "tolerance"),
    ("fit point 2**70", lambda: gpuops._C.fit_memory_profile([(HUGE, 1), (2, 2)]), ValueError, "points[0]"),
    ("knapsack bytes 2**70", lambda: choose_for_budget([LayerCost("a", HUGE, 0, 1.0)], 0), ValueError,
     "saved_bytes"),
    ("knapsack budget 2**70", lambda: choose_for_budget([LayerCost("a", 5, 0, 1.0)], HUGE), ValueError,
     "budget_bytes"),
    ("checkpoint fn", lambda: gpuops.checkpoint(5, torch.ones(1, requires_grad=True)), TypeError, "fn"),
    ("checkpoint buffers", lambda: gpuops.checkpoint(torch.sin, torch.ones(1, requires_grad=True), buffers=[1]),
     TypeError, "buffers"),
    ("checkpoint buffers None", lambda: gpuops.checkpoint(torch.sin, torch.ones(1, requires_grad=True),
                                                          buffers=None), TypeError, "buffers"),
    ("checkpoint preserve_rng_state", lambda: gpuops.checkpoint(torch.sin, torch.ones(1, requires_grad=True),
                                                                preserve_rng_state="x"), TypeError,
     "preserve_rng_state"),
    ("clip parameters None", lambda: gpuops.clip_grad_norm_(None, 1.0), TypeError, "parameters"),
    ("clip parameters ints", lambda: gpuops.clip_grad_norm_([1, 2], 1.0), TypeError, "parameters[0]"),
    ("clip max_norm str", lambda: gpuops.clip_grad_norm_([param(3)], "1"), TypeError, "max_norm"),
    ("clip max_norm None", lambda: gpuops.clip_grad_norm_([param(3)], None), TypeError, "max_norm"),
    ("clip norm_type None", lambda: gpuops.clip_grad_norm_([param(3)], 1.0, None), TypeError, "norm_type"),
    ("scale str", lambda: gpuops.GradScaler("cpu").scale("loss"), TypeError, "outputs"),
    ("scale dict", lambda: gpuops.GradScaler("cpu").scale({"a": torch.ones(())}), TypeError, "outputs"),
    ("accumulator optimizer None", lambda: gpuops.GradAccumulator(None, 2), TypeError, "optimizer"),
    ("accumulator on_boundary", lambda: gpuops.GradAccumulator(gpuops.optim.SGD([param(3)], lr=0.1), 2,
                                                               on_boundary="x"), TypeError, "on_boundary"),
    ("cache_key model", lambda: cache_key(model=5), TypeError, "model"),
    ("cache_key sequence_length", lambda: cache_key(sequence_length="x"), TypeError, "sequence_length"),
    ("cache_key extra", lambda: cache_key(extra=None), TypeError, "extra"),
    ("cache_key device", lambda: cache_key(device="tpu"), ValueError, "device"),
    ("model_signature None", lambda: model_signature(None), TypeError, "model"),
    ("analytic_profile breakdown", lambda: analytic_profile(None, 1), TypeError, "breakdown"),
    ("analytic_profile bool", lambda: analytic_profile(gpuops.estimate("gpt2"), True), ValueError, "micro_batch"),
    ("search cache_key", lambda: gpuops.find_max_batch_size(lambda b: None, cache_file="c.json", cache_key=5),
     ValueError, "cache_key"),
    ("search restore", lambda: gpuops.find_max_batch_size(lambda b: None, restore=[object()]), TypeError,
     "restore[0]"),
    ("search device", lambda: gpuops.find_max_batch_size(lambda b: None, device="tpu"), ValueError, "device"),
    ("profile step_fn", lambda: gpuops.profile_memory(None), ValueError, "step_fn"),
    ("profile bool batch", lambda: gpuops.profile_memory(lambda b: None, [True, 2]), ValueError, "batch_sizes"),
    ("profile 2**70 batch", lambda: gpuops.profile_memory(lambda b: None, [HUGE, 1]), ValueError, "batch_sizes"),
    ("profile str batches", lambda: gpuops.profile_memory(lambda b: None, "12"), ValueError, "batch_sizes"),
    ("search high < low", lambda: gpuops.find_max_batch_size(lambda b: None, low=10, high=5), ValueError, "high"),
]


@pytest.mark.parametrize("call, error, name", [c[1:] for c in ARGUMENT_CASES], ids=[c[0] for c in ARGUMENT_CASES])
def test_bad_arguments_get_a_typed_error_naming_them(call, error, name):
    with pytest.raises(error) as caught:
        call()
    message = str(caught.value)
    assert "incompatible" not in message and "Invoked with" not in message, message  # pybind11's signature dump
    assert name in message, message


@pytest.mark.parametrize("method", ["unscale_", "step", "clip_grad_norm_", "set_grad_divisor"])
@pytest.mark.parametrize("optimizer", [None, object()], ids=["None", "object"])
def test_scaler_methods_name_a_non_optimizer_and_record_nothing(method, optimizer):
    scaler = gpuops.GradScaler("cpu")
    w = param(3)
    scaler.scale(w.sum()).backward()
    args = {"clip_grad_norm_": (1.0,), "set_grad_divisor": (2.0,)}.get(method, ())
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        getattr(scaler, method)(optimizer, *args)
    assert not scaler._per_optimizer  # no per-optimizer entry made for a refused call


@pytest.mark.parametrize("max_norm, error", [("1", TypeError), (None, TypeError), (NAN, ValueError), (0, ValueError)])
def test_scaler_clip_refuses_non_numbers_before_touching_the_gradients(max_norm, error):
    scaler = gpuops.GradScaler("cpu")
    w = param(3)
    optimizer = gpuops.optim.SGD([w], lr=0.1)
    scaler.scale(w.sum()).backward()
    grad = w.grad.clone()
    with pytest.raises(error, match="max_norm"):
        scaler.clip_grad_norm_(optimizer, max_norm)
    assert torch.equal(w.grad, grad)
    scaler.step(optimizer)  # the step goes on as if the refused call had not been made
    scaler.update()


def test_scaler_clip_takes_a_max_norm_beyond_float32():
    """2**70 (a Python int) overflowed in the division by the norm; it clips nothing, as inf does."""
    scaler = gpuops.GradScaler("cpu")
    w = param(5)
    optimizer = gpuops.optim.SGD([w], lr=0.1)
    scaler.scale(w.sum()).backward()
    norm = scaler.clip_grad_norm_(optimizer, HUGE)
    assert torch.allclose(norm, torch.full((), 5**0.5))


def test_clip_with_nan_norm_type_is_refused_and_leaves_the_gradients():
    """torch's would multiply every gradient by NaN."""
    w = param(4)
    w.grad = torch.randn(4)
    grad = w.grad.clone()
    with pytest.raises(ValueError, match="norm_type"):
        gpuops.clip_grad_norm_([w], 1.0, NAN)
    assert torch.equal(w.grad, grad)


@pytest.mark.parametrize("norm_type", [2.0, "inf", 1.0])
def test_clip_of_a_generator_and_of_float64_matches_torch(norm_type):
    grads = [torch.randn(5, dtype=torch.float64), torch.randn(3, dtype=torch.float64)]
    ours, theirs = [], []
    for target in (ours, theirs):
        for g in grads:
            p = torch.nn.Parameter(torch.zeros_like(g))
            p.grad = g.clone()
            target.append(p)
    total = gpuops.clip_grad_norm_((p for p in ours), 0.5, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type)
    assert torch.allclose(total.double(), expected.double())
    for a, b in zip(ours, theirs):
        assert torch.allclose(a.grad, b.grad)


def test_a_budget_of_minus_one_is_refused_not_unlimited():
    with pytest.raises(ValueError, match="limit_bytes"):
        with gpuops.memory_budget(-1):
            torch.zeros(1 << 20)
    with pytest.raises(torch.OutOfMemoryError):  # a real limit still holds
        with gpuops.memory_budget(1000):
            torch.zeros(1 << 20)


@pytest.mark.parametrize("fail", ["on_boundary", "optimizer"])
def test_a_window_whose_step_failed_steps_at_the_next_micro_batch(fail):
    """The window stayed complete and was never stepped again (micro_batches passed the window size)."""
    torch.manual_seed(0)
    w = param(4)
    reference = w.detach().clone()
    optimizer = gpuops.optim.SGD([w], lr=0.1)
    calls = []

    def on_boundary():
        calls.append(1)
        if fail == "on_boundary" and len(calls) == 1:
            raise RuntimeError("reduce failed")

    accumulator = gpuops.GradAccumulator(optimizer, 2, on_boundary=on_boundary)
    xs = [torch.randn(4) for _ in range(3)]
    accumulator.backward((w * xs[0]).sum(), 1)
    if fail == "optimizer":
        optimizer.param_groups[0]["lr"] = NAN
    with pytest.raises((RuntimeError, ValueError)):
        accumulator.backward((w * xs[1]).sum(), 1)
    optimizer.param_groups[0]["lr"] = 0.1
    assert torch.equal(w.detach(), reference)
    assert accumulator.backward((w * xs[2]).sum(), 2)  # the pending window steps, with every sample's gradient
    assert accumulator.micro_batches == 0
    expected = reference - 0.1 * (xs[0] + xs[1] + xs[2]) / 4
    assert torch.allclose(w.detach(), expected, atol=1e-6)


def layers(n=4):
    return torch.nn.ModuleList([torch.nn.Linear(3, 3) for _ in range(n)])


def wrapped(stack):
    return ["_gpuops_forward" in m.__dict__ for m in stack]


@pytest.mark.parametrize("bad", [
    dict(names=["nope"]), dict(names="01"), dict(every=True), dict(every=0), dict(budget_bytes=10, sample=3),
    dict(budget_bytes=10, sample=lambda: 1 / 0), dict(budget_bytes=HUGE, sample=lambda: None),
], ids=["unknown name", "str names", "bool every", "every 0", "sample not callable", "sample raises", "huge budget"])
def test_a_refused_policy_keeps_the_previous_one(bad):
    stack = layers()
    assert gpuops.apply_checkpointing(stack, every=2) == ["0", "2"]
    with pytest.raises(Exception) as caught:
        gpuops.apply_checkpointing(stack, **bad)
    assert not isinstance(caught.value, (AttributeError, KeyError)), caught.value
    assert wrapped(stack) == [True, False, True, False]


def test_the_budget_policy_measures_without_the_previous_wrappers():
    """(The refused-policy fix moved the removal of the previous choice: the measurement must still see plain
    layers, or checkpointed ones would seem to save only their inputs.)"""
    stack = layers(3)
    x = torch.randn(8, 3, requires_grad=True)
    seen = []

    def sample():
        seen.append(wrapped(stack))
        h = x
        for layer in stack:
            h = torch.relu(layer(h))
        h.sum().backward()

    gpuops.apply_checkpointing(stack, every=1)
    gpuops.apply_checkpointing(stack, budget_bytes=1 << 30, sample=sample)
    assert seen == [[False, False, False]]


def test_profile_memory_takes_a_generator_of_batch_sizes():
    def step(batch):
        torch.zeros(batch * 1000)

    fitted = gpuops.profile_memory(step, (b for b in (1, 2)), device="cpu")
    assert fitted.per_sample_bytes == 4000


def test_a_first_batch_beyond_the_memory_is_refused_before_any_trial():
    calls = []
    with gpuops.memory_budget(1 << 20):
        with pytest.raises(ValueError, match="multiple_of=4611686018427387904.*cannot fit"):
            gpuops.find_max_batch_size(calls.append, multiple_of=2**62)
    assert calls == []


def test_a_profile_predicts_no_negative_batch():
    profile = gpuops._C.fit_memory_profile([(1, 1000), (2, 2000)])
    with pytest.raises(ValueError, match="batch must be >= 0"):
        profile.predict(-1)
