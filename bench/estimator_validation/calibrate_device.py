"""The estimator calibrated on the device at hand (scripts/gpu-run's estimator step).

    python3 bench/estimator_validation/calibrate_device.py --device cuda --profile device-profile.json --json out.json
    .venv/bin/python bench/estimator_validation/calibrate_device.py --device cpu --quick      # rehearsal

On CUDA, in this order (each before anything that would disturb it):
1. the caching allocator: a random trace of allocations and frees replayed through torch's allocator and through
   the estimator's model of it (gpuops._C.replay_caching_allocator): peak allocated and reserved, byte for byte;
2. the cuBLAS/cuBLASLt workspaces: what a forward and backward in fp32 and bf16 leave allocated once their
   tensors are gone (the table says 2 x (32 + 1) MiB on sm_90);
3. a grid of small Hugging Face models (sizes, batches, checkpointing, LoRA, fp32 / bf16-mixed / bf16) trained
   for two steps each: torch.cuda.max_memory_allocated, max_memory_reserved and the device's used memory (NVML,
   above its idle value) against the estimator's three figures, with the table's CUDA profile and with the
   profile measured here; and the CUDA context (used memory minus reserved) after each case.
It writes device-profile.json (`gpuops estimate --device-profile`) and the median / max error per figure. The
grid stops early when --budget-s (default: $GPUOPS_STEP_BUDGET_S, else 75) runs out: its cases are shuffled so
that any prefix covers every dimension.

On the CPU (a rehearsal): the same code paths with the CPU's meter (gpuops.memory_budget) on a few cases, the
allocator model alone, and a profile marked as a rehearsal that the estimator refuses to read.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import itertools
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from typing import Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import gpuops  # noqa: E402
import results_json  # noqa: E402
from validate import MODELS, Case, LoraCase, estimate_case, measure_case  # noqa: E402

MiB = 1 << 20
# Larger than validate.py's (which are sized for CPU steps): tens of millions of parameters, so that the
# figures are not dominated by the workspaces and the allocator's rounding.
GPU_MODELS = {**{name: (kind, dict(cfg, n_pos=512) if kind == "gpt2" else cfg) for name, (kind, cfg) in MODELS.items()},
              "llama-mid": ("llama", dict(h=1024, L=4, a=16, kv=4, i=2816, V=32000, tied=False)),
              "gpt2-mid": ("gpt2", dict(h=768, L=6, a=12, V=32000, tied=True, n_pos=512))}  # GPT-2: seq 512 fits
LORA_ON = ["llama-tied", "llama-mqa-wide", "llama-mid"]


# ------------------------------------------------------------------------------------------------ reading
def used_bytes() -> Optional[int]:
    """The device's used memory as nvidia-smi shows it (NVML), or None without a GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used)
    except Exception:  # noqa: BLE001: no pynvml, or no driver: ask nvidia-smi
        pass
    if not shutil.which("nvidia-smi"):
        return None
    r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                       capture_output=True, text=True)
    return int(r.stdout.split()[0]) * MiB if r.returncode == 0 and r.stdout.strip() else None


def catalog_gpu() -> Optional[dict]:
    """The catalog GPU of the device's compute capability nearest to its memory (an H100 80GB: H100-80GB)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    same = [g for g in gpuops.gpu_catalog() if g["compute_capability"] == f"{props.major}.{props.minor}"]
    return min(same, key=lambda g: abs(g["memory_bytes"] - props.total_memory), default=None)


# ------------------------------------------------------------------------------------ allocator and workspaces
def allocator_trace(seed: int = 0, steps: int = 600) -> list:
    """Allocations of mixed sizes (small pool, 1-10 MiB, large) and frees in random order: sizes > 0, and
    -(k + 1) to free the k-th allocation."""
    rng = random.Random(seed)
    trace, live, made = [], [], 0
    for _ in range(steps):
        if live and rng.random() < 0.45:
            trace.append(-(live.pop(rng.randrange(len(live))) + 1))
            continue
        kind = rng.random()
        size = (rng.randint(1, MiB) if kind < 0.5 else rng.randint(MiB + 1, 10 * MiB) if kind < 0.8
                else rng.randint(10 * MiB + 1, 120 * MiB))
        trace.append(size)
        live.append(made)
        made += 1
    return trace


def replay_on_device(trace: list) -> dict:
    """The trace through torch's caching allocator (uint8 tensors): peaks above what was there before."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base_allocated, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    tensors = []
    for op in trace:
        if op > 0:
            tensors.append(torch.empty(op, dtype=torch.uint8, device="cuda"))
        else:
            tensors[-(op + 1)] = None
    peaks = {"peak_allocated": torch.cuda.max_memory_allocated() - base_allocated,
             "peak_reserved": torch.cuda.max_memory_reserved() - base_reserved}
    del tensors
    torch.cuda.empty_cache()
    return peaks


def check_allocator(on_cuda: bool) -> dict:
    """The model against torch's allocator on three traces (the model alone on the CPU)."""
    rows = []
    for seed in range(3):
        trace = allocator_trace(seed)
        model = gpuops._C.replay_caching_allocator(trace)
        row = {"seed": seed, "ops": len(trace), "model": dict(model)}
        if on_cuda:
            row["torch"] = replay_on_device(trace)
            row["exact"] = all(row["torch"][k] == model[k] for k in ("peak_allocated", "peak_reserved"))
        rows.append(row)
    return {"traces": rows, "exact": sum(r.get("exact", False) for r in rows) if on_cuda else None}


def workspace_bytes() -> int:
    """What a forward and backward (fp32, then bf16 under autocast) leave allocated once their tensors are gone:
    the cuBLAS and cuBLASLt workspaces of the forward's and the autograd thread's handles."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for autocast in (False, True):
        layer = torch.nn.Linear(1024, 1024, device="cuda")
        x = torch.randn(64, 1024, device="cuda", requires_grad=True)
        with torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            layer(x).square().mean().backward()
        del layer, x
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before


# ---------------------------------------------------------------------------------------------------- grid
def grid() -> list:
    """Every model x precision x checkpointing (shapes, optimizers, attention alternating) and LoRA cases,
    shuffled with a fixed seed: any prefix covers the dimensions."""
    shapes = [(2, 128), (8, 512)]
    cases = []
    for k, (model, precision, ckpt) in enumerate(itertools.product(GPU_MODELS, ["fp32", "bf16-mixed", "bf16"],
                                                                     [False, True])):
        batch, seq = shapes[k % 2]
        cases.append(Case(model, batch, seq, precision, ["adamw", "sgd-momentum"][(k // 2) % 2], ckpt,
                          ["sdpa", "eager"][(k // 3) % 2]))
    for k, (model, precision, ckpt) in enumerate(itertools.product(LORA_ON, ["bf16-mixed", "fp32"], [False, True])):
        cases.append(LoraCase(model, precision, ckpt, "sdpa", [("q", "v"), ("q", "k", "v", "o", "gate", "up", "down")]
                              [k % 2], [8, 64][(k // 2) % 2], 0.0, batch=4, seq=256))
    random.Random(0).shuffle(cases)
    return cases


def error(estimated: int, measured: int) -> float:
    return (estimated - measured) / measured


def run_case(case, on_cuda: bool, idle: Optional[int], gpu: Optional[str]) -> dict:
    """One case measured and estimated (the table's CUDA profile); on CUDA the three figures and the context."""
    gc.collect()
    if not on_cuda:
        measured = measure_case(case, GPU_MODELS)["peak"]
        estimate = estimate_case(case, GPU_MODELS, device="cpu")
        return {"case": case.label(), "measured": {"allocated": measured},
                "estimated": {"allocated": estimate.allocated_peak},
                "error": {"allocated": error(estimate.allocated_peak, measured)}}
    row = {"case": case.label()}
    add_estimate(row, case, "table", gpu=gpu)  # first: a setup the estimator refuses never reaches the device
    torch.cuda.empty_cache()
    phases = measure_case(case, GPU_MODELS, device="cuda", meter="cuda")["phases"]
    reserved_now = torch.cuda.memory_reserved()  # the segments stay cached: the reserved peak, still held
    used = used_bytes() - idle
    row["measured"] = {"allocated": max(p["abs_peak"] for p in phases.values()),
                       "reserved": max(p["abs_reserved_peak"] for p in phases.values()), "used": used}
    # where each peak is, to find a term's cause from the log (the first run's GQA + checkpointing cases were
    # 18-21% under on CUDA and exact on the CPU): every phase's allocated peak against the estimate's peak phase
    row["measured_phase_peaks"] = {name: p["abs_peak"] for name, p in phases.items()}
    row["context"] = used - reserved_now
    row["error_table"] = {k: error(row["estimated_table"][k], row["measured"][k]) for k in row["measured"]}
    return row


def add_estimate(row: dict, case, name: str, **cuda) -> None:
    """The estimator's three figures for `case` on CUDA as row[estimated_<name>], and their errors as
    row[error_<name>] when the row holds its measurement."""
    b = estimate_case(case, GPU_MODELS, device="cuda", **cuda)
    estimated = {"allocated": b.allocated_peak, "reserved": b.reserved_peak, "used": b.total_bytes}
    row[f"estimated_{name}"] = estimated
    row["estimated_peak_phase"] = b.peak_phase
    if "measured" in row:
        row[f"error_{name}"] = {k: error(estimated[k], row["measured"][k]) for k in estimated}


def statistics_of(rows: list, key: str) -> dict:
    """Per figure: cases, median and max |error|, the worst under-estimate."""
    out = {}
    for figure in ("allocated", "reserved", "used"):
        errors = [r[key][figure] for r in rows if key in r and figure in r[key]]
        if errors:
            out[figure] = {"cases": len(errors), "median_abs": statistics.median(abs(e) for e in errors),
                           "max_abs": max(abs(e) for e in errors), "most_under": min(errors)}
    return out


def write_profile(path: str, on_cuda: bool, figures: dict, details: dict) -> None:
    """device-profile.json: the figures the estimator reads (docs/estimator.md, "Measured device profiles") and
    the details behind them; on the CPU a rehearsal profile, which the estimator refuses."""
    profile = {"format": "gpuops-device-profile", "version": 1, "date": datetime.date.today().isoformat(),
               "torch": torch.__version__, "cuda": torch.version.cuda}
    if not on_cuda:
        profile.update(rehearsal=True, gpu="none (a rehearsal on the CPU: no measurement)")
    else:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"],
                                capture_output=True, text=True).stdout.strip() or "?"
        profile.update(gpu=props.name, compute_capability=10 * props.major + props.minor, driver=driver, **figures,
                       details=details)
    results_json.write_json_atomically(path, profile)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--profile", default="device-profile.json", help="where the measured profile goes")
    parser.add_argument("--json", help="rows and headline figures (scripts/gpu-run)")
    parser.add_argument("--budget-s", type=float, default=float(os.environ.get("GPUOPS_STEP_BUDGET_S", 75)))
    parser.add_argument("--quick", action="store_true", help="two grid cases (the rehearsal)")
    args = parser.parse_args()
    began = time.monotonic()
    on_cuda = args.device == "cuda"
    if on_cuda and not torch.cuda.is_available():
        sys.exit("calibrate_device.py: --device cuda but torch sees no CUDA device")
    idle = used_bytes() if on_cuda else None  # before this process makes its context
    figures, profile, details = {}, {}, {}
    if on_cuda:
        torch.cuda.init()
        allocator = check_allocator(True)  # first: nothing else in the allocator yet
        context_init = used_bytes() - idle - torch.cuda.memory_reserved()
        profile["workspace_bytes"] = workspace_bytes()
        details = {"idle_used_bytes": idle, "context_after_init_bytes": context_init, "allocator": allocator,
                   "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                   "context_after_matmul_bytes": used_bytes() - idle - torch.cuda.memory_reserved()}
        gpu = catalog_gpu()
        print(f"allocator model exact on {allocator['exact']}/3 traces; workspaces "
              f"{profile['workspace_bytes'] / MiB:.1f} MiB; context {context_init / MiB:.0f} MiB after init, "
              f"{details['context_after_matmul_bytes'] / MiB:.0f} MiB after a matmul; catalog GPU "
              f"{gpu['name'] if gpu else 'none of this compute capability'}", flush=True)
    else:
        allocator, gpu = check_allocator(False), None
    rows = []
    cases = grid()
    if args.quick:  # one full fine-tune and one LoRA case of the small models
        cases = [next(c for c in cases if isinstance(c, kind) and c.model in MODELS) for kind in (Case, LoraCase)]
    for case in cases:
        if rows and time.monotonic() - began > args.budget_s - 5:
            print(f"budget of {args.budget_s:.0f} s reached after {len(rows)} of {len(cases)} cases", flush=True)
            break
        try:
            rows.append(run_case(case, on_cuda, idle, gpu["name"] if gpu else None))
        except Exception as e:  # noqa: BLE001: a case that fails is reported, the grid goes on
            rows.append({"case": case.label(), "failed": f"{type(e).__name__}: {e}"})
        print(rows[-1], flush=True)
    done = [(r, c) for r, c in zip(rows, cases) if "failed" not in r]
    if on_cuda and done:
        contexts = sorted(r["context"] for r, _ in done)
        profile.update(context_bytes=int(statistics.median(contexts)), context_low_bytes=contexts[0],
                       context_high_bytes=contexts[-1])
        details["context_per_case"] = contexts
    write_profile(args.profile, on_cuda, profile, details)
    if on_cuda and done:  # the grid again through the estimator, with the profile just measured
        for row, case in done:
            add_estimate(row, case, "measured", gpu=gpu["name"] if gpu else None, device_profile=args.profile)
    done = [r for r, _ in done]
    keys = ("error_table", "error_measured") if on_cuda else ("error",)
    stats = {key: statistics_of(done, key) for key in keys}
    figures["cases"] = f"{len(done)} measured, {len(rows) - len(done)} failed"
    for key, per_figure in stats.items():
        for figure, s in per_figure.items():
            figures[f"{figure} ({key.replace('error_', '')} profile)" if on_cuda else figure] = (
                f"median {100 * s['median_abs']:.1f}%, max {100 * s['max_abs']:.1f}%, most under "
                f"{100 * s['most_under']:+.1f}%")
    if on_cuda:
        figures["workspaces MiB"] = f"{profile['workspace_bytes'] / MiB:.1f} (table: 66)"
        if "context_bytes" in profile:
            figures["context MiB"] = (f"{profile['context_bytes'] / MiB:.0f} (range {profile['context_low_bytes'] / MiB:.0f}"
                                      f"-{profile['context_high_bytes'] / MiB:.0f}; table: 500, 300-700)")
        figures["allocator replay exact"] = f"{allocator['exact']}/3 traces"
    else:
        figures["allocator model"] = f"{len(allocator['traces'])} traces replayed (no torch allocator on the CPU)"
    results_json.write(args.json, args.device, figures, [{"grid": rows, "statistics": stats, "profile": profile,
                                                          "details": details}])
    for k, v in figures.items():
        print(f"{k}: {v}")
    if not done:
        sys.exit("calibrate_device.py: no grid case could be measured")


if __name__ == "__main__":
    main()
