"""Step time of a 12-layer transformer with every layer checkpointed against without (issue target: at
most 1.4x), and with the budget policy at half the activation bytes. Same process, same data.

    .venv/bin/python bench/checkpoint_overhead.py --width 256 --seq 256 --batch 8
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch

import gpuops


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.TransformerEncoderLayer(args.width, 8, 4 * args.width, dropout=0.1,
                                                                  batch_first=True) for _ in range(args.layers))
    x = torch.randn(args.batch, args.seq, args.width)

    def step():
        h = x
        for layer in layers:
            h = layer(h)
        h.square().mean().backward()

    def timed() -> float:
        step()  # warm-up
        samples = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            step()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    plain = timed()
    gpuops.apply_checkpointing(layers, every=1)
    full = timed()
    gpuops.remove_checkpointing(layers)
    costs = gpuops.checkpointing.measure_layers(layers, step)
    chosen = gpuops.apply_checkpointing(layers, budget_bytes=sum(c.saved_bytes for c in costs) // 2, sample=step)
    half = timed()
    print(f"# {datetime.date.today()}, {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; {args.layers} layers, width {args.width}, seq {args.seq}, batch {args.batch}")
    print("| policy | step ms | vs no checkpointing |")
    print("|---|---:|---:|")
    print(f"| none | {1e3 * plain:.1f} | 1.00x |")
    print(f"| every layer | {1e3 * full:.1f} | {full / plain:.2f}x |")
    print(f"| budget: half the activations ({len(chosen)} layers) | {1e3 * half:.1f} | {half / plain:.2f}x |")


if __name__ == "__main__":
    main()
