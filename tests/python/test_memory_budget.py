"""gpuops.memory_budget against real autograd allocations, with torch's profiler as the reference."""

import random

import pytest
import torch

import gpuops
from conftest import requires_cuda


def make_mlp(width: int, depth: int) -> torch.nn.Module:
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def profiler_peak(fn) -> int:
    """Peak of the running sum of CPU allocations (and frees) that torch's profiler records during fn."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    memory_events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for event in sorted(memory_events, key=lambda e: e.start_ns()):
        current += event.nbytes()
        peak = max(peak, current)
    return peak


def test_counts_an_allocation_exactly():
    n = random.randint(1000, 100000)
    with gpuops.memory_budget() as mb:
        t = torch.empty(n, dtype=torch.float64)
        assert mb.current_bytes == 8 * n
        del t
        assert mb.current_bytes == 0
    assert mb.peak_bytes == 8 * n
    assert not mb.active


def test_peak_of_forward_backward_matches_the_profiler():
    torch.manual_seed(random.randint(0, 2**31))
    width, batch = random.choice([96, 128, 160]), random.randint(8, 64)
    model = make_mlp(width, 3)
    x = torch.randn(batch, width)

    def step():  # starts with no gradients, so the window frees nothing allocated before it
        model(x).square().mean().backward()

    step()  # warm-up: lazily created state does not count below
    model.zero_grad(set_to_none=True)
    reference = profiler_peak(step)
    model.zero_grad(set_to_none=True)
    with gpuops.memory_budget() as mb:
        step()
    assert reference > 0
    assert mb.peak_bytes == reference


def test_out_of_memory_inside_backward_is_torch_out_of_memory_error_and_allocator_is_restored():
    torch.manual_seed(0)
    model = make_mlp(256, 4)
    x = torch.randn(64, 256)
    with gpuops.memory_budget() as unlimited:
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    limit = unlimited.peak_bytes * 3 // 4  # room for the forward, not for all the gradients
    with pytest.raises(torch.OutOfMemoryError, match="limit_bytes"):
        with gpuops.memory_budget(limit) as mb:
            loss = model(x).sum()
            loss.backward()
    assert mb.stats().failed_allocations >= 1
    big = torch.empty(4 * limit // 4 + 1024, dtype=torch.uint8)  # no budget any more
    assert big.numel() > limit


def test_nested_budgets_count_in_both():
    with gpuops.memory_budget(8 << 20) as outer:
        a = torch.empty(1 << 20, dtype=torch.uint8)
        with gpuops.memory_budget(2 << 20) as inner:
            b = torch.empty(1 << 20, dtype=torch.uint8)
            assert inner.current_bytes == 1 << 20
            assert outer.current_bytes == 2 << 20
            with pytest.raises(torch.OutOfMemoryError):
                torch.empty(2 << 20, dtype=torch.uint8)
        del b
        assert outer.current_bytes == 1 << 20
        del a


@pytest.mark.parametrize(
    "kwargs, match",
    [({"limit_bytes": 0}, "limit_bytes"), ({"limit_bytes": -3}, "limit_bytes"), ({"device": "tpu"}, "device"),
     ({"device": "meta"}, "device")],
)
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gpuops.memory_budget(**kwargs)


@requires_cuda
def test_cuda_budget_reports_the_caching_allocator_peak():
    n = random.randint(1 << 20, 1 << 22)
    with gpuops.memory_budget(device="cuda") as mb:
        t = torch.empty(n, dtype=torch.float32, device="cuda")
        del t
    assert mb.peak_bytes >= 4 * n
    assert mb.peak_bytes == pytest.approx(4 * n, rel=0.01, abs=2 << 20)


@requires_cuda
def test_cuda_budget_caps_the_allocator():
    with pytest.raises(torch.OutOfMemoryError):
        with gpuops.memory_budget(64 << 20, device="cuda"):
            torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # the cap is gone
