"""The AMP training step under torch.compile (inductor) against the same step run eagerly, for our GradScaler +
AdamW and for torch's: how far the compiled run's parameters land from the eager run's (float rounding: ours
should be within the gap torch's own pair shows) and the step time of each.

    python3 bench/compiled_step.py --device cuda
    .venv/bin/python bench/compiled_step.py --device cpu

The forward and backward are compiled; the scalers' methods and the optimizer steps break the graph and run
eagerly (as torch's GradScaler's do). tests/python/test_compile.py asserts the gap with these helpers.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Optional

import torch

import gpuops
import results_json


def amp_step(model, optimizer, scaler, x, y):
    optimizer.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss.detach()


def device_of(model) -> str:
    return next(model.parameters()).device.type


def ours(model):
    return model, gpuops.optim.AdamW(model.parameters(), lr=1e-2), gpuops.GradScaler(device_of(model), init_scale=256.0)


def torchs(model):
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), torch.amp.GradScaler(device_of(model),
                                                                                        init_scale=256.0)


def train(model, optimizer, scaler, batches, backend, times: Optional[list] = None):
    """The steps over `batches` (compiled with `backend`, or eager for None); each step's seconds into `times`."""
    step = amp_step if backend is None else torch.compile(amp_step, backend=backend)
    for x, y in batches:
        if x.is_cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        step(model, optimizer, scaler, x, y)
        if x.is_cuda:
            torch.cuda.synchronize()
        if times is not None:
            times.append(time.perf_counter() - began)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def compiled_vs_eager(make, start, batches, backend="inductor", times: Optional[dict] = None) -> float:
    """Relative gap between the parameters after a compiled and an eager run from the same start; `times`, when
    given, gets each run's step seconds ("compiled", "eager": the compiled run's first step compiles)."""
    runs = {} if times is None else times
    compiled = train(*make(copy.deepcopy(start)), batches, backend, runs.setdefault("compiled", []))
    eager = train(*make(copy.deepcopy(start)), batches, None, runs.setdefault("eager", []))
    assert torch.isfinite(eager).all()
    return ((compiled - eager).norm() / eager.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--width", type=int, default=None, help="hidden width (default 2048 on CUDA, 64 on the CPU)")
    parser.add_argument("--steps", type=int, default=12, help="steps of each run: the parameters compared after "
                        "them, the median time of all but the first two")
    parser.add_argument("--json", help="also write the rows and the headline figures here (scripts/gpu-run)")
    args = parser.parse_args()
    if args.steps < 3:
        parser.error(f"--steps must be at least 3 (the first two are not timed), got {args.steps}")
    device = torch.device(args.device)
    width = args.width or (2048 if device.type == "cuda" else 64)
    torch.manual_seed(0)
    start = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width),
                                torch.nn.LayerNorm(width), torch.nn.Linear(width, 16)).to(device)
    batches = [(torch.randn(64, width, device=device), torch.randn(64, 16, device=device)) for _ in range(args.steps)]
    rows = []
    for name, make in (("torch", torchs), ("gpuops", ours)):
        torch._dynamo.reset()
        times = {}
        gap = compiled_vs_eager(make, start, batches, times=times)
        eager, compiled = (statistics.median(times[run][2:]) for run in ("eager", "compiled"))
        rows.append({"pair": name, "gap": gap, "eager_s": eager, "compiled_s": compiled})
        print(f"{name}: compiled vs eager parameters {gap:.2e} apart after {args.steps} steps; step "
              f"{1e3 * eager:.2f} ms eager, {1e3 * compiled:.2f} ms compiled", flush=True)
    theirs, mine = rows
    within = mine["gap"] <= max(2 * theirs["gap"], 1e-6)
    print(f"gpuops' gap {'within' if within else 'OUTSIDE'} max(2 x torch's, 1e-6)")
    results_json.write(args.json, args.device,
                       {"gap ours / torch": f"{mine['gap']:.1e} / {theirs['gap']:.1e}",
                        "compiled / eager step": f"{mine['compiled_s'] / mine['eager_s']:.2f}x (torch's "
                                                 f"{theirs['compiled_s'] / theirs['eager_s']:.2f}x)"}, rows)
    if not within:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
