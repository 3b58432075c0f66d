"""torch.compile: a whole AMP training step with our GradScaler and AdamW, compiled, stays within float rounding of
the same step run eagerly, as torch's own GradScaler + AdamW do (their compiled-vs-eager gap is the tolerance);
our ops also compile inside a graph (fake kernels, functionalization, inductor). Compiled cases are few: inductor
compiles are slow on a small machine."""

import random
import sys
from pathlib import Path

import pytest
import torch

import gpuops  # noqa: F401  (torch.ops.gpuops)
from conftest import DEVICES

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from compiled_step import amp_step as _amp_step, compiled_vs_eager, ours as _ours, torchs as _torchs  # noqa: E402

STEPS = 5


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_amp_step_matches_eager_as_torchs_does(device):
    """Forward, scaler.scale(loss).backward(), scaler.step(opt), scaler.update() under torch.compile (inductor):
    the forward and backward are compiled; the scaler's methods and the optimizer step run eagerly (graph breaks,
    as torch's GradScaler's). After 5 steps our parameters are within float rounding of our eager run: at most
    the gap torch's own GradScaler + AdamW show between their compiled and eager runs (floor 1e-6)."""
    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(random.randint(0, 2**31))
    start = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(device)
    batches = [(torch.randn(8, 16, generator=generator).to(device), torch.randn(8, 4, generator=generator).to(device))
               for _ in range(STEPS)]
    torchs_gap = compiled_vs_eager(_torchs, start, batches, "inductor")
    ours_gap = compiled_vs_eager(_ours, start, batches, "inductor")
    assert ours_gap <= max(2 * torchs_gap, 1e-6), (ours_gap, torchs_gap)


def test_compiled_step_skips_on_overflow_as_eager_does():
    """An overflowing step inside the compiled region is skipped and backs the scale off, as in eager mode
    (aot_eager: the same graphs without inductor's compile time)."""
    torch._dynamo.reset()
    results = []
    for backend in ("aot_eager", None):
        model = torch.nn.Linear(4, 2)
        torch.nn.init.constant_(model.weight, 0.5)
        model, optimizer, scaler = _ours(model)
        before = model.weight.detach().clone()
        step = _amp_step if backend is None else torch.compile(_amp_step, backend=backend)
        step(model, optimizer, scaler, torch.full((3, 4), float("inf")), torch.zeros(3, 2))
        assert torch.equal(model.weight, before) and scaler.get_scale() == 128.0 and scaler.skipped_steps == 1
        step(model, optimizer, scaler, torch.ones(3, 4), torch.zeros(3, 2))
        results.append(model.weight.detach().clone())
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("device", DEVICES)
def test_our_ops_compile_into_one_graph(device):
    """The ops themselves trace (fullgraph: no graph break) and run under inductor: a hand-written AMP step over
    unscaled_grad_norm_, adam_step_ and update_scale_ gives the eager step's bits and writes its inputs in place."""
    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(random.randint(0, 2**31))

    def state():
        params = [torch.randn(s, generator=generator) for s in ((5, 3), (7,))]
        grads = [torch.randn(p.shape, generator=generator) * 64.0 for p in params]
        moments = [torch.rand(p.shape, generator=generator) for p in params for _ in range(2)]
        tensors = [params, grads, moments[0::2], moments[1::2], [torch.tensor(3.0) for _ in params],
                   torch.tensor([64.0]), torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)]
        return [[t.to(device) for t in v] if isinstance(v, list) else v.to(device) for v in tensors]

    def step(params, grads, exp_avgs, exp_avg_sqs, steps, scale, tracker, hysteresis):
        found_inf = torch.zeros(1, device=scale.device)
        norm = torch.ops.gpuops.unscaled_grad_norm_(grads, scale.reciprocal(), found_inf)
        clip = (1.0 / (norm + 1e-6)).clamp(max=1.0)
        torch.ops.gpuops.adam_step_(params, grads, exp_avgs, exp_avg_sqs, [], steps, 1e-2, 0.9, 0.999, 1e-8, 1e-2,
                                    True, False, False, scale / clip, found_inf)
        torch.ops.gpuops.update_scale_(scale, tracker, hysteresis, found_inf, 2.0, 0.5, 1, 1, 0.0, 0.0)
        return norm

    eager = state()
    compiled = [[t.clone() for t in v] if isinstance(v, list) else v.clone() for v in eager]
    params = compiled[0]
    eager_norm = step(*eager)
    compiled_norm = torch.compile(step, fullgraph=True)(*compiled)
    assert compiled[0] is params  # written in place, not replaced
    torch.testing.assert_close(compiled_norm, eager_norm, rtol=0, atol=0)
    for a, b in zip(compiled, eager):
        for x, y in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b]):
            assert torch.equal(x, y)
