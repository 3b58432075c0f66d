"""Optimizer offload (issue 33): a training step of gpuops.ZeroOptimizer(stage=2) with offload="cpu" against the
same step without offload, one process (a group of one), and on a GPU torchao's CPUOffloadOptimizer (fused
torch AdamW on the host) when it imports. Per stack: the median step time (forward, backward, step), its ratio
to the step without offload, the device's peak bytes (CUDA: max_memory_allocated; CPU: gpuops.memory_budget,
the host allocations of the offload outside it) and, offloaded, where the step's time went (offload_timeline():
gradient copies to the host, host steps, parameter copies back, summed over the buckets).

    .venv/bin/python bench/offload.py --device cpu --params 2e7 [--json out.json]
    python3 bench/offload.py --device cuda --params 1e9 --dtype bf16        # scripts/gpu-run's step

The model is an MLP of --layers square Linear layers (bias-free) sized to --params; every stack sees the same
data. On the CPU both sides of the copies are host memory: the figures say what the offload's own work costs
(the copies, the bucket-by-bucket host step), not what a GPU's PCIe copies cost.
"""

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_json  # noqa: E402

import gpuops  # noqa: E402


def _model(params: float, layers: int, dtype: torch.dtype, device: str) -> torch.nn.Module:
    width = int(math.sqrt(params / layers))
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width, bias=False), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks).to(device=device, dtype=dtype)


def _make(stack: str, model: torch.nn.Module):
    if stack == "torchao CPUOffloadOptimizer":
        from torchao.optim import CPUOffloadOptimizer

        return CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, fused=True, lr=1e-4)
    return gpuops.ZeroOptimizer(model.parameters(), "adamw", stage=2, lr=1e-4, bucket_bytes=64 << 20,
                                offload="cpu" if stack == "gpuops offload" else None)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_stack(stack: str, args, dtype: torch.dtype) -> dict:
    device = args.device
    model = _model(args.params, args.layers, dtype, device)
    width = model[0].in_features
    x = torch.randn(args.batch, width, device=device, dtype=dtype)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    budget = gpuops.memory_budget() if device == "cpu" else None
    if budget:
        budget.__enter__()
    try:
        optimizer = _make(stack, model)
        times = []
        for step in range(args.warmup + args.steps):
            _sync(device)
            start = time.perf_counter()
            optimizer.zero_grad()
            model(x).float().square().mean().backward()
            optimizer.step()
            _sync(device)
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
        peak = budget.peak_bytes if budget else torch.cuda.max_memory_allocated()
    finally:
        if budget:
            budget.__exit__(None, None, None)
    row = {"stack": stack, "params": sum(p.numel() for p in model.parameters()), "step_ms": 1e3 * statistics.median(times),
           "device_peak_bytes": int(peak)}
    if stack == "gpuops offload":
        spent = {}
        for what, _, begin, end in optimizer.offload_timeline():
            spent[what] = spent.get(what, 0.0) + (end - begin)
        row["timeline_ms"] = {what: round(1e3 * s, 3) for what, s in spent.items()}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--params", type=float, default=2e7)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", help="write the rows here (with the machine and date)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("offload.py: --device cuda but no CUDA device is visible")
    import torch.distributed as dist

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=600))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    stacks = ["gpuops", "gpuops offload"]
    if args.device == "cuda":
        try:
            import torchao.optim  # noqa: F401

            stacks.append("torchao CPUOffloadOptimizer")
        except ImportError:
            print("# torchao does not import here: its CPUOffloadOptimizer is left out", flush=True)
    rows = [run_stack(stack, args, dtype) for stack in stacks]
    base = rows[0]["step_ms"]
    print(f"# {datetime.date.today()}, {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.layers} layers, {args.dtype}, ZeroOptimizer stage 2 at one rank")
    print("| stack | params | step ms | vs not offloaded | device peak MiB | offloaded step: where the time went |")
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        r["vs_not_offloaded"] = r["step_ms"] / base
        spent = ", ".join(f"{k} {v:.1f} ms" for k, v in r.get("timeline_ms", {}).items())
        print(f"| {r['stack']} | {r['params']:.3g} | {r['step_ms']:.2f} | {r['vs_not_offloaded']:.2f}x | "
              f"{r['device_peak_bytes'] / 2**20:.1f} | {spent} |")
    offloaded = next(r for r in rows if r["stack"] == "gpuops offload")
    figures = {"offload_vs_not": offloaded["vs_not_offloaded"],
               "device_peak_saved_bytes": rows[0]["device_peak_bytes"] - offloaded["device_peak_bytes"]}
    theirs = next((r for r in rows if r["stack"].startswith("torchao")), None)
    if theirs:
        figures["speedup_vs_torchao"] = theirs["step_ms"] / offloaded["step_ms"]
    results_json.write(args.json, args.device, figures, rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
