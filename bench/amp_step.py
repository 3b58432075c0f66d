"""The AMP step, torch's pipeline against ours, in the same process (issue: mixed precision).

(a) the AdamW step: torch.optim.AdamW(fused=True) vs gpuops.optim.AdamW;
(b) the whole AMP step: torch's scaler.unscale_ + clip_grad_norm_ + fused AdamW + update vs
    gpuops.GradScaler.clip_grad_norm_ + gpuops.optim.AdamW + update.

    .venv/bin/python bench/amp_step.py --device cpu --params 1e6 1e7 1e8
    .venv/bin/python bench/amp_step.py --device cpu --params 1e6 1e7 --state-bits 8   # ours with 8-bit moments

Prints, per size: median seconds, bytes moved per parameter (counted from the kernels), achieved GB/s
and the ratio torch / ours. Gradients are restored before every repeat, outside the timing: from a saved
copy, or (--regenerate-grads, for 1e9 parameters on a 24 GiB machine) drawn again from the same seed.
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

# Bytes per fp32 parameter, counted from what each kernel reads and writes.
BYTES = {
    "torch_adamw": 4 + 3 * 8,  # grad read, param/exp_avg/exp_avg_sq read+write
    "gpuops_adamw": 4 + 3 * 8,
    "torch_amp_step": 8 + 4 + 8 + 28,  # unscale r/w, norm read, clip r/w, fused AdamW
    "gpuops_amp_step": 4 + 28,  # pass 1 reads the grads; pass 2 is the fused AdamW
}
# With 8-bit moments: the grad read, param read+write, two codes read+written (scales: 1/64 byte, left out).
BYTES_8BIT = {"gpuops_adamw": 4 + 8 + 2 * 2, "gpuops_amp_step": 4 + 4 + 8 + 2 * 2}


def make_params(n: int, device: str, chunks: int = 8):
    sizes = [n // chunks + (1 if i < n % chunks else 0) for i in range(chunks)]
    return [torch.nn.Parameter(torch.randn(s, device=device) * 0.02) for s in sizes]


def gradient_restorer(params, regenerate: bool):
    """restore(): sets every .grad to the same gradients of a loss scaled by 1024, each time it is called."""
    def draw(p: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        generator = torch.Generator(device=p.device).manual_seed(p.numel())
        return out.normal_(generator=generator).mul_(1024.0)

    saved = None if regenerate else [draw(p, torch.empty_like(p)) for p in params]

    def restore():
        for k, p in enumerate(params):
            if p.grad is None:
                p.grad = torch.empty_like(p)
            if saved is None:
                draw(p, p.grad)
            else:
                p.grad.copy_(saved[k])
    return restore


def timed(fn, restore, repeats: int, device: str) -> float:
    samples = []
    for _ in range(repeats):
        restore()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench_size(n: int, device: str, repeats: int, chunks: int, flat: bool, regenerate: bool,
               state_bits: int = 32) -> dict:
    results = {}
    for name in ("torch", "gpuops"):
        params = make_params(n, device, chunks)
        flat_params = gpuops.FlatParams(params) if flat and name == "gpuops" else None
        restore = gradient_restorer(params, regenerate)

        if name == "torch":
            optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
            scaler = torch.amp.GradScaler(device, init_scale=1024.0, growth_interval=10**9)

            def adamw():
                optimizer.step()

            def amp_step():
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
                scaler.step(optimizer)
                scaler.update()
        else:
            # --flat: the parameters live in one buffer, and the optimizer steps that buffer (flat state too)
            stepped = flat_params.flat_parameters() if flat_params is not None else params
            optimizer = gpuops.optim.AdamW(stepped, lr=1e-3, state_bits=state_bits)
            scaler = gpuops.GradScaler(device, init_scale=1024.0, growth_interval=10**9)

            def adamw():
                optimizer.step()

            def amp_step():
                scaler.clip_grad_norm_(optimizer, max_norm=1.0)
                scaler.step(optimizer)
                scaler.update()

        scaler.scale(torch.ones((), device=device))  # the scaler's state exists before timing
        restore()
        adamw()  # optimizer state allocated outside the timing
        results[f"{name}_adamw"] = timed(adamw, restore, repeats, device)
        results[f"{name}_amp_step"] = timed(amp_step, restore, repeats, device)
        del params, restore, optimizer, flat_params
    return results


def copy_bandwidth(n: int, device: str, repeats: int) -> float:
    """GB/s of a plain n-float copy (4 bytes read + 4 written per element): the memory system's ceiling that
    the issue's GPU target (>= 85% of it) is stated against."""
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    seconds = timed(lambda: dst.copy_(src), lambda: None, repeats, device)
    return 8 * n / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--params", type=float, nargs="+", default=[1e6, 1e7, 1e8])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--chunks", type=int, default=8, help="parameter tensors the parameters are split into")
    parser.add_argument("--flat", action="store_true", help="gpuops: parameters in a FlatParams buffer, stepped as one")
    parser.add_argument("--regenerate-grads", action="store_true",
                        help="draw the gradients again before each repeat instead of keeping a copy (4 bytes less "
                             "per parameter: 1e9 parameters fit in 17 GB)")
    parser.add_argument("--state-bits", type=int, default=32, choices=(8, 32),
                        help="gpuops: 8-bit moments (state_bits=8) against torch's float32 ones")
    parser.add_argument("--json", help="also write the rows and the headline figures here (scripts/gpu-run)")
    args = parser.parse_args()
    machine = torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.processor() or platform.machine()}"
    print(f"# {datetime.date.today()}, {machine}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.chunks} tensors{', gpuops flat' if args.flat else ''}, gpuops state_bits={args.state_bits}")
    print("| params | step | torch ms | gpuops ms | torch GB/s | gpuops GB/s | bytes/param torch / ours | speed-up "
          "| gpuops / copy GB/s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    rows, figures = [], {}
    layout = f"{args.chunks} tensors{' flat' if args.flat else ''}{' 8-bit' if args.state_bits == 8 else ''}"
    ours_bytes = {**BYTES, **(BYTES_8BIT if args.state_bits == 8 else {})}
    for n in (int(p) for p in args.params):
        r = bench_size(n, args.device, args.repeats, args.chunks, args.flat, args.regenerate_grads, args.state_bits)
        copy = copy_bandwidth(n, args.device, args.repeats)
        for step in ("adamw", "amp_step"):
            t_torch, t_ours = r[f"torch_{step}"], r[f"gpuops_{step}"]
            b_torch, b_ours = BYTES[f"torch_{step}"], ours_bytes[f"gpuops_{step}"]
            of_copy = 100 * n * b_ours / t_ours / 1e9 / copy
            print(f"| {n:.0e} | {step} | {1e3 * t_torch:.2f} | {1e3 * t_ours:.2f} | {n * b_torch / t_torch / 1e9:.1f} | "
                  f"{n * b_ours / t_ours / 1e9:.1f} | {b_torch} / {b_ours} | {t_torch / t_ours:.2f}x | "
                  f"{of_copy:.0f}% of {copy:.1f} |", flush=True)
            rows.append({"params": n, "step": step, "layout": layout, "torch_s": t_torch, "gpuops_s": t_ours,
                         "bytes_per_param": [b_torch, b_ours], "copy_gb_s": copy, "speedup": t_torch / t_ours,
                         "percent_of_copy": of_copy})
            if step == "amp_step":
                figures[f"{layout} {n:.0e}"] = f"{t_torch / t_ours:.2f}x, {of_copy:.0f}% of copy"
    results_json.write(args.json, args.device, figures, rows)


if __name__ == "__main__":
    main()
