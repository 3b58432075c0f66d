"""What gpuops.metrics.Recorder costs per step: the AMP step of bench/amp_step.py (gpuops' GradScaler clip +
AdamW + update on N fp32 parameters) timed with and without `recorder.step_done(...)`, in the same process
(issue 24's goal: under 1% of a step at log_every=10 on 1e7 parameters).

    .venv/bin/python bench/metrics_overhead.py --device cpu --params 1e7 --log-every 10
    .venv/bin/python bench/metrics_overhead.py --all-sinks   # JSON Lines, CSV, TensorBoard and Prometheus at once
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import os

import torch

import gpuops
import results_json
from amp_step import gradient_restorer, make_params


def steps_seconds(device: str, n: int, steps: int, recorder) -> float:
    """Seconds per step over `steps` AMP steps (gradients restored outside the timing)."""
    params = make_params(n, device)
    restore = gradient_restorer(params, regenerate=False)
    optimizer = gpuops.optim.AdamW(params, lr=1e-4)
    scaler = gpuops.GradScaler(device, init_scale=1024.0, growth_interval=10**9)
    loss = torch.ones((), device=device)
    scaler.scale(loss)
    total = 0.0
    for _ in range(steps):
        restore()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        norm = scaler.clip_grad_norm_(optimizer, max_norm=1.0)
        scaler.step(optimizer)
        scaler.update()
        if recorder is not None:
            recorder.step_done(loss, optimizer=optimizer, scaler=scaler, grad_norm=norm, tokens=4096, samples=8)
        if device == "cuda":
            torch.cuda.synchronize()
        total += time.perf_counter() - start
    return total / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--params", type=float, default=1e7)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40, help="steps per timed run (a multiple of --log-every)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each, alternating; the medians compared")
    parser.add_argument("--all-sinks", action="store_true",
                        help="record to JSON Lines, CSV, TensorBoard and a Prometheus endpoint at once (those built)")
    parser.add_argument("--json", help="rows and headline figures (scripts/gpu-run)")
    args = parser.parse_args()
    n = int(args.params)
    folder = tempfile.mkdtemp(prefix="gpuops-metrics-")
    plain, recorded = [], []
    for repeat in range(args.repeats):  # alternating, so that drift hits both alike
        plain.append(steps_seconds(args.device, n, args.steps, None))
        sinks = {}
        if args.all_sinks:
            sinks = dict(csv=os.path.join(folder, f"run{repeat}.csv"),
                         tensorboard=(os.path.join(folder, f"tb{repeat}") if gpuops.metrics.tensorboard_available()
                                      else None),
                         prometheus_port=0 if gpuops.metrics.prometheus_available() else None)
        recorder = gpuops.metrics.Recorder(log_every=args.log_every,
                                           jsonl=os.path.join(folder, f"run{repeat}.jsonl"), **sinks)
        recorded.append(steps_seconds(args.device, n, args.steps, recorder))
        recorder.close()
    base, with_recorder = statistics.median(plain), statistics.median(recorded)
    overhead = (with_recorder - base) / base
    print(f"{args.device}, {n:.0e} parameters, log_every {args.log_every}"
          f"{' (JSON Lines, CSV, TensorBoard, Prometheus)' if args.all_sinks else ''}: step {base * 1e3:.3f} ms without the "
          f"recorder, {with_recorder * 1e3:.3f} ms with it: {100 * overhead:+.2f}% (medians of {args.repeats})")
    results_json.write(args.json, args.device, {f"recorder overhead {n:.0e}": f"{100 * overhead:+.2f}%"},
                       [{"params": n, "log_every": args.log_every, "step_s": base, "step_with_recorder_s": with_recorder,
                         "overhead": overhead}])


if __name__ == "__main__":
    main()
