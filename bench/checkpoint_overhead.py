"""Step time of a 12-layer transformer with every layer checkpointed against without (issue target: at
most 1.4x), with the budget policy at half the activation bytes, with every layer's activations offloaded to
host memory (offload_activations), and with the three-choice policy (apply_activation_policy: keep, offload or
recompute per layer) at half, with the peak memory of each. Same process, same data.

    .venv/bin/python bench/checkpoint_overhead.py --width 256 --seq 256 --batch 8
    python3 bench/checkpoint_overhead.py --device cuda --width 1024 --seq 1024 --batch 8

The peak is gpuops.memory_budget's over one step: the bytes the step adds to the weights and gradients it
finds (activations and temporaries), from torch.cuda's allocator statistics on CUDA and from a counting
allocator in front of c10's on the CPU.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch

import gpuops
import results_json


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="also write the rows and the headline figures here (scripts/gpu-run)")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.TransformerEncoderLayer(args.width, 8, 4 * args.width, dropout=0.1,
                                                                  batch_first=True) for _ in range(args.layers))
    layers.to(device)
    x = torch.randn(args.batch, args.seq, args.width, device=device)

    def step():
        h = x
        for layer in layers:
            h = layer(h)
        h.square().mean().backward()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def timed() -> tuple:
        """Median seconds of a step, and the peak bytes of one step."""
        step()  # warm-up
        with gpuops.memory_budget(device=device) as budget:
            sync()
            budget.reset_peak()
            step()
            sync()
            peak = budget.peak_bytes
        samples = []
        for _ in range(args.repeats):
            sync()
            start = time.perf_counter()
            step()
            sync()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples), peak

    plain, plain_peak = timed()
    gpuops.apply_checkpointing(layers, every=1)
    full, full_peak = timed()
    gpuops.remove_checkpointing(layers)
    costs = gpuops.checkpointing.measure_layers(layers, step)
    half_budget = sum(c.saved_bytes for c in costs) // 2
    chosen = gpuops.apply_checkpointing(layers, budget_bytes=half_budget, sample=step)
    half, half_peak = timed()
    gpuops.remove_checkpointing(layers)
    offloaded = gpuops.offload_activations(layers)  # activations to host memory, prefetched back (issue 33)
    offload, offload_peak = timed()
    offloaded.remove()
    plan = gpuops.apply_activation_policy(layers, half_budget, step)  # keep, offload or recompute per layer
    mixed, mixed_peak = timed()
    counts = {c: list(plan.choices.values()).count(c) for c in ("keep", "offload", "recompute")}
    machine = torch.cuda.get_device_name() if device.type == "cuda" else platform.machine()
    print(f"# {datetime.date.today()}, {machine}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; {args.layers} layers, width {args.width}, seq {args.seq}, batch {args.batch}")
    print("| policy | step ms | vs no checkpointing | peak MiB |")
    print("|---|---:|---:|---:|")
    rows = [("none", plain, plain_peak), ("every layer", full, full_peak),
            (f"budget: half the activations ({len(chosen)} layers)", half, half_peak),
            ("activations offloaded, every layer", offload, offload_peak),
            (f"budget, keep/offload/recompute: half ({counts['offload']} offloaded, {counts['recompute']} "
             "recomputed)", mixed, mixed_peak)]
    for name, seconds, peak in rows:
        print(f"| {name} | {1e3 * seconds:.1f} | {seconds / plain:.2f}x | {peak / 2**20:.1f} |")
    results_json.write(args.json, args.device,
                       {"every layer": f"{full / plain:.2f}x time, {full_peak / plain_peak:.2f}x peak",
                        "half budget": f"{half / plain:.2f}x time, {half_peak / plain_peak:.2f}x peak",
                        "offload every layer": f"{offload / plain:.2f}x time, {offload_peak / plain_peak:.2f}x peak",
                        "half budget, three choices": f"{mixed / plain:.2f}x time, {mixed_peak / plain_peak:.2f}x "
                                                      "peak"},
                       [{"policy": n, "step_s": s, "peak_bytes": p, "shape": [args.layers, args.width, args.seq,
                                                                               args.batch]} for n, s, p in rows])


if __name__ == "__main__":
    main()
