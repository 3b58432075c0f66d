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


def steps_seconds(device: str, n: int, steps: int, recorder) -> tuple:
    """(seconds per step, of which inside the recorder's step_done) over `steps` AMP steps (gradients restored
    outside the timing). The second is the recorder's own host time, records included: steady where the
    difference of two runs is noise, but blind to what the recorder costs outside its call (device copies the
    step then waits for, caches it disturbs), which only the difference of the runs holds."""
    params = make_params(n, device)
    restore = gradient_restorer(params, regenerate=False)
    optimizer = gpuops.optim.AdamW(params, lr=1e-4)
    scaler = gpuops.GradScaler(device, init_scale=1024.0, growth_interval=10**9)
    loss = torch.ones((), device=device)
    scaler.scale(loss)
    total = inside = 0.0
    for _ in range(steps):
        restore()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        norm = scaler.clip_grad_norm_(optimizer, max_norm=1.0)
        scaler.step(optimizer)
        scaler.update()
        if recorder is not None:
            call = time.perf_counter()
            recorder.step_done(loss, optimizer=optimizer, scaler=scaler, grad_norm=norm, tokens=4096, samples=8)
            inside += time.perf_counter() - call
        if device == "cuda":
            torch.cuda.synchronize()
        total += time.perf_counter() - start
    return total / steps, inside / steps


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
    plain, recorded, inside = [], [], []
    for repeat in range(args.repeats):  # alternating, so that drift hits both alike
        plain.append(steps_seconds(args.device, n, args.steps, None)[0])
        sinks = {}
        if args.all_sinks:
            sinks = dict(csv=os.path.join(folder, f"run{repeat}.csv"),
                         tensorboard=(os.path.join(folder, f"tb{repeat}") if gpuops.metrics.tensorboard_available()
                                      else None),
                         prometheus_port=0 if gpuops.metrics.prometheus_available() else None)
        recorder = gpuops.metrics.Recorder(log_every=args.log_every,
                                           jsonl=os.path.join(folder, f"run{repeat}.jsonl"), **sinks)
        step_s, recorder_s = steps_seconds(args.device, n, args.steps, recorder)
        recorded.append(step_s)
        inside.append(recorder_s)
        recorder.close()
    base, with_recorder = statistics.median(plain), statistics.median(recorded)
    overhead = (with_recorder - base) / base
    own = statistics.median(inside)
    print(f"{args.device}, {n:.0e} parameters, log_every {args.log_every}"
          f"{' (JSON Lines, CSV, TensorBoard, Prometheus)' if args.all_sinks else ''}: step {base * 1e3:.3f} ms without the "
          f"recorder, {with_recorder * 1e3:.3f} ms with it: {100 * overhead:+.2f}% (medians of {args.repeats}); "
          f"inside step_done: {own * 1e6:.1f} us a step, {100 * own / base:.2f}% of the step")
    results_json.write(args.json, args.device, {f"recorder overhead {n:.0e}": f"{100 * overhead:+.2f}%",
                                                f"recorder's own time {n:.0e}": f"{100 * own / base:.2f}%"},
                       [{"params": n, "log_every": args.log_every, "step_s": base, "step_with_recorder_s": with_recorder,
                         "overhead": overhead, "step_done_s": own, "step_done_share": own / base}])


if __name__ == "__main__":
    main()
