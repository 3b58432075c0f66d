"""CUDA only (skipped without a GPU): the kernels give the CPU loops' bits, a steady-state AMP step makes no
host sync (torch.cuda.set_sync_debug_mode("error")), and the whole AMP step replays from a CUDA graph."""

import copy
import random

import pytest
import torch

import gpuops

from conftest import requires_cuda

pytestmark = requires_cuda

SHAPES = [(7,), (33, 17), (65537,), (3, 5, 7), (2, 65540)]  # the last: the kernels' vector-load path, two chunks
OPTIMIZERS = [
    (gpuops.optim.AdamW, dict(lr=1e-3, weight_decay=0.05)),
    (gpuops.optim.Adam, dict(lr=1e-3, weight_decay=0.01, amsgrad=True)),
    (gpuops.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-4)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=["adamw", "adam-amsgrad", "sgd-nesterov"])
def test_cuda_steps_give_the_cpu_loops_bits(optimizer, dtype):
    """One element math for both (kernels/math, no FMA contraction on either side): same bits after 20 steps
    with a loss scale folded in, master copies included."""
    cls, kwargs = optimizer
    generator = torch.Generator().manual_seed(random.randint(0, 2**31))
    start = [torch.randn(s, generator=generator).to(dtype) for s in SHAPES]
    on_cpu = [torch.nn.Parameter(p.clone()) for p in start]
    on_gpu = [torch.nn.Parameter(p.clone().cuda()) for p in start]
    cpu_opt, gpu_opt = cls(on_cpu, **kwargs), cls(on_gpu, **kwargs)
    cpu_scaler, gpu_scaler = gpuops.GradScaler("cpu", init_scale=512.0), gpuops.GradScaler("cuda", init_scale=512.0)
    for _ in range(20):
        for a, b in zip(on_cpu, on_gpu):
            g = (torch.randn(a.shape, generator=generator) * 512.0).to(dtype)  # a scaled gradient
            a.grad, b.grad = g, g.cuda()
        for scaler, opt, params in ((cpu_scaler, cpu_opt, on_cpu), (gpu_scaler, gpu_opt, on_gpu)):
            scaler.scale(params[0].sum())  # makes the scaler's state; the gradients are set above
            scaler.step(opt)
            scaler.update()
    for a, b in zip(on_cpu, on_gpu):
        assert torch.equal(a, b.cpu())
        for name, value in cpu_opt.state[a].items():
            assert torch.equal(value, gpu_opt.state[b][name].cpu()), name


def test_launches_split_over_tensors_and_chunks_give_the_cpu_bits():
    """More tensors than one launch table holds (24) and one tensor longer than a launch's 320 chunks of
    64 Ki elements: the splits step every element once, and the step counters advance once per step."""
    generator = torch.Generator().manual_seed(random.randint(0, 2**31))
    shapes = [(1000 + k,) for k in range(30)] + [(320 * 65536 + 12345,)]
    start = [torch.randn(s, generator=generator) for s in shapes]
    on_cpu = [torch.nn.Parameter(p.clone()) for p in start]
    on_gpu = [torch.nn.Parameter(p.clone().cuda()) for p in start]
    cpu_opt, gpu_opt = gpuops.optim.AdamW(on_cpu, lr=1e-3), gpuops.optim.AdamW(on_gpu, lr=1e-3)
    for _ in range(3):
        for a, b in zip(on_cpu, on_gpu):
            a.grad = torch.randn(a.shape, generator=generator)
            b.grad = a.grad.cuda()
        cpu_opt.step()
        gpu_opt.step()
    for a, b in zip(on_cpu, on_gpu):
        assert torch.equal(a, b.cpu())
        assert float(gpu_opt.state[b]["step"]) == 3.0


def amp_model():
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64),
                               torch.nn.LayerNorm(64), torch.nn.Linear(64, 8)).cuda()


def amp_step(model, optimizer, scaler, x, max_norm=1.0):
    """The steady-state step: zero, autocast forward, scaled backward, fused clip (pass 1), step (pass 2)."""
    optimizer.zero_grad(set_to_none=False)
    with torch.autocast("cuda", dtype=torch.float16, cache_enabled=False):  # as graph capture needs
        loss = model(x).float().square().mean()
    scaler.scale(loss).backward()
    norm = scaler.clip_grad_norm_(optimizer, max_norm)
    scaler.step(optimizer)
    scaler.update()
    return loss, norm


def test_steady_state_amp_step_makes_no_host_sync():
    torch.manual_seed(random.randint(0, 2**31))
    model = amp_model()
    optimizer = gpuops.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scaler = gpuops.GradScaler("cuda", init_scale=2.0**12)
    inputs = [torch.randn(32, 64, device="cuda") for _ in range(6)]
    inputs[4][0, 0] = float("inf")  # one overflow inside the watched steps: the skip is sync-free too
    for x in inputs[:2]:  # warm-up: optimizer state and scaler tensors are made here
        amp_step(model, optimizer, scaler, x)
    before = [p.detach().clone() for p in model.parameters()]
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host read now raises
    try:
        for x in inputs[2:]:
            amp_step(model, optimizer, scaler, x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert scaler.skipped_steps == 1 and scaler.get_scale() == 2.0**11
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def capture_amp_step(model, optimizer, scaler, warmup):
    """Warms the step up on a side stream (as torch's capture asks), then captures it once on a static input;
    returns (graph, static input, static loss, static norm)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x in warmup:
            amp_step(model, optimizer, scaler, x)
    torch.cuda.current_stream().wait_stream(side)
    static_x = torch.empty_like(warmup[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss, static_norm = amp_step(model, optimizer, scaler, static_x)
    return graph, static_x, static_loss, static_norm


def test_the_whole_amp_step_replays_from_a_cuda_graph():
    """Capture zero_grad + forward + backward + clip + step + update once, replay it on fresh inputs (one
    with a NaN), and compare with the same steps run eagerly: same scale, same skips, same parameters."""
    torch.manual_seed(random.randint(0, 2**31))
    eager_model = amp_model()
    graph_model = copy.deepcopy(eager_model)
    make = lambda m: (gpuops.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01),
                      gpuops.GradScaler("cuda", init_scale=2.0**12))
    (eager_opt, eager_scaler), (graph_opt, graph_scaler) = make(eager_model), make(graph_model)
    warmup = [torch.randn(32, 64, device="cuda") for _ in range(3)]
    inputs = [torch.randn(32, 64, device="cuda") for _ in range(6)]
    inputs[3][5, 7] = float("nan")
    for x in warmup:
        amp_step(eager_model, eager_opt, eager_scaler, x)
    graph, static_x, static_loss, static_norm = capture_amp_step(graph_model, graph_opt, graph_scaler, warmup)
    for x in inputs:
        static_x.copy_(x)
        graph.replay()
        loss, norm = amp_step(eager_model, eager_opt, eager_scaler, x)
        assert graph_scaler.get_scale() == eager_scaler.get_scale()
        torch.testing.assert_close(static_loss, loss, equal_nan=True)
        torch.testing.assert_close(static_norm, norm, equal_nan=True)
    assert graph_scaler.skipped_steps == eager_scaler.skipped_steps == 1
    for a, b in zip(graph_model.parameters(), eager_model.parameters()):
        assert torch.equal(a, b)  # the same kernels on the same data


def test_a_captured_step_follows_the_lr_scheduler():
    """With its lr in a device tensor, a step captured once uses whatever the scheduler wrote last: the
    same parameters as eager steps given that lr as a float."""
    torch.manual_seed(random.randint(0, 2**31))
    eager_model = amp_model()
    graph_model = copy.deepcopy(eager_model)
    lr = torch.tensor(1e-3, device="cuda")
    graph_opt = gpuops.optim.AdamW(graph_model.parameters(), lr=lr, weight_decay=0.01)
    # the eager one is given the float32 value the tensor holds (the kernels take a host lr as a double)
    eager_opt = gpuops.optim.AdamW(eager_model.parameters(), lr=float(lr), weight_decay=0.01)
    graph_scaler = gpuops.GradScaler("cuda", init_scale=2.0**12)
    eager_scaler = gpuops.GradScaler("cuda", init_scale=2.0**12)
    warmup = [torch.randn(32, 64, device="cuda") for _ in range(3)]
    for x in warmup:
        amp_step(eager_model, eager_opt, eager_scaler, x)
    graph, static_x, _, _ = capture_amp_step(graph_model, graph_opt, graph_scaler, warmup)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(graph_opt, gamma=0.5)
    for _ in range(5):
        x = torch.randn(32, 64, device="cuda")
        eager_opt.param_groups[0]["lr"] = float(lr)
        static_x.copy_(x)
        graph.replay()
        amp_step(eager_model, eager_opt, eager_scaler, x)
        scheduler.step()
    assert float(lr) == pytest.approx(1e-3 * 0.5**5)
    for a, b in zip(graph_model.parameters(), eager_model.parameters()):
        assert torch.equal(a, b)
