"""Batch-size tuning per GPU model: the largest batch that trains and the throughput per batch size.

For each target memory - each catalog GPU the GPU at hand can emulate with a memory cap, or CPU memory
budgets when there is no GPU - it finds the largest batch with gpuops.find_max_batch_size, then times a
ladder of batch sizes (1, 2, 4, ..., the maximum). Results go to bench/results/<target>.json; a Markdown
table (batch_tuning.md) and one plot per target (batch_tuning/<target>.png: throughput and peak memory against
the batch) are rendered from them into bench/results too (--docs; docs/ gets them by a deliberate copy).

    # the built-in GPT-2-style model written with LibTorch (bench/tune_batch_size.cpp):
    .venv/bin/python bench/tune_batch_size.py --budgets 128MiB,512MiB
    # a Python model: a module-level factory(device) -> step(batch) that runs one training step
    .venv/bin/python bench/tune_batch_size.py --module mypkg.tuning:make_step --budgets 1GiB

What a cap cannot emulate: another GPU's CUDA context, NCCL buffers, and the kernels and workspaces
cuBLAS/cuDNN choose on another chip. A CPU budget counts tensor allocations only.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List

import torch

ROOT = Path(__file__).resolve().parents[1]
BUILTIN = ROOT / "build" / "py" / "bench" / "tune_batch_size"
UNITS = {"GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10}


def parse_bytes(text: str) -> int:
    for unit, scale in UNITS.items():
        if text.endswith(unit):
            value = float(text[: -len(unit)])
            if value > 0:
                return int(value * scale)
    raise argparse.ArgumentTypeError(f"--budgets: sizes like 256MiB or 2GiB, got {text!r}")


def survive(step: Callable, batch: int, count: int) -> int:
    """How many of `count` more steps at `batch` run before an out-of-memory error (fragmentation of the
    caching allocator over a long run shows here, not in the search's few steps)."""
    import gpuops

    for done in range(count):
        try:
            step(batch)
        except Exception as error:  # noqa: BLE001: only an OOM ends the count; anything else propagates
            if not gpuops.batch_size.is_out_of_memory(error):
                raise
            return done
    return count


def tune_python_module(factory: Callable, targets: List[tuple], out: Path, steps: int, name: str,
                       survive_steps: int = 0) -> List[Path]:
    """Runs the search, the throughput ladder and `survive_steps` more steps at the largest batch for step
    functions made by factory(device)."""
    import gpuops
    from tqdm import tqdm

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    written = []
    for target, limit in tqdm(targets, desc="targets", unit="target"):
        torch.manual_seed(0)
        step = factory(device)
        with gpuops.memory_budget(limit, device) as cap:
            found = gpuops.find_max_batch_size(step, device=device)
            cap.reset_peak()
            survived = survive(step, found.max_batch, survive_steps) if found.max_batch else 0
            survive_peak = cap.peak_bytes
            sizes = sorted({2**i for i in range(found.max_batch.bit_length()) if 2**i < found.max_batch}
                           | {found.max_batch})
            ladder = []
            for b in tqdm(sizes, desc=target, unit="batch", leave=False):
                cap.reset_peak()
                step(b)  # warm-up
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(steps):
                    step(b)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                seconds = (time.perf_counter() - start) / steps
                ladder.append({"batch": b, "samples_per_s": b / seconds, "step_seconds": seconds,
                               "peak_bytes": cap.peak_bytes})
        result = {"target": target, "limit_bytes": limit, "device": device.type,
                  "date": datetime.date.today().isoformat(), "model": {"name": name},
                  "max_batch": found.max_batch, "recommended": found.recommended,
                  "trials": [{"batch": t.batch, "ok": t.ok, "peak_bytes": t.peak_bytes, "seconds": t.seconds,
                              "phase": t.phase} for t in found.trials],
                  "throughput": ladder,
                  "survived": {"steps": survive_steps, "ran": survived, "peak_bytes": survive_peak},
                  "caveats": "a CPU memory budget counts tensor allocations only" if device.type == "cpu" else
                             "a memory cap cannot emulate another GPU's CUDA context, NCCL buffers or kernels"}
        path = out / f"{target}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        written.append(path)
    return written


def render(results: List[Path], docs: Path) -> Path:
    """<docs>/batch_tuning.md (one row per target) and <docs>/batch_tuning/<target>.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = docs / "batch_tuning"
    plots.mkdir(parents=True, exist_ok=True)
    rows = []
    for path in results:
        r = json.loads(path.read_text())
        if not r["throughput"]:
            rows.append(f"| {r['target']} | {r['limit_bytes'] / 2**20:.0f} | {r['model']['name']} | does not fit "
                        f"| - | {len(r['trials'])} | - | {r['date']} |")
            continue
        best = max(r["throughput"], key=lambda p: p["samples_per_s"])
        failed = sum(not t["ok"] for t in r["trials"])
        rows.append(f"| {r['target']} | {r['limit_bytes'] / 2**20:.0f} | {r['model']['name']} | {r['max_batch']} | "
                    f"{r['recommended']} | {len(r['trials'])} ({failed} OOM) | {best['samples_per_s']:.1f} at "
                    f"{best['batch']} | {r['date']} |")
        fig, left = plt.subplots(figsize=(6, 3.5))
        batches = [p["batch"] for p in r["throughput"]]
        left.plot(batches, [p["samples_per_s"] for p in r["throughput"]], "o-", color="tab:blue")
        left.set_xscale("log", base=2)
        left.set_xlabel("batch size")
        left.set_ylabel("samples/s", color="tab:blue")
        right = left.twinx()
        right.plot(batches, [p["peak_bytes"] / 2**20 for p in r["throughput"]], "s--", color="tab:red")
        right.axhline(r["limit_bytes"] / 2**20, color="tab:red", linewidth=0.8)
        right.set_ylabel("peak MiB (line: limit)", color="tab:red")
        left.set_title(f"{r['target']}: {r['model']['name']}")
        fig.tight_layout()
        fig.savefig(plots / f"{r['target']}.png", dpi=100)
        plt.close(fig)
    table = docs / "batch_tuning.md"
    caveats = sorted({json.loads(p.read_text())["caveats"] for p in results})
    table.write_text(
        "# Batch-size tuning results\n\nWritten by `bench/tune_batch_size.py` from its results' JSON; plots in "
        "`batch_tuning/` beside this file.\n\n| target | MiB | model | max batch | recommended | trials | best samples/s "
        "| date |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\nCaveats: " + "; ".join(caveats) +
        ".\n")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", help="package.module:factory, factory(device) -> step(batch); default: the "
                        "built-in LibTorch GPT-2-style model")
    parser.add_argument("--budgets", type=lambda s: [parse_bytes(x) for x in s.split(",")],
                        help="memory targets (default: the catalog GPUs on a GPU, 128MiB,512MiB on the CPU)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per batch size")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--docs", type=Path, default=ROOT / "bench" / "results",
                        help="where the table and plots go (default: beside the results, not docs/)")
    parser.add_argument("--survive", type=int, default=0, help="with --module: this many more steps at the "
                        "largest batch, counting those that run before an out-of-memory error")
    parser.add_argument("--json", help="also write each target's headline figures here (scripts/gpu-run)")
    args, builtin_args = parser.parse_known_args()
    if args.survive < 0:
        parser.error(f"--survive must be >= 0, got {args.survive}")
    if args.survive and not args.module:
        parser.error("--survive needs --module (the built-in model's tool does not run it)")
    args.out.mkdir(parents=True, exist_ok=True)
    budgets = args.budgets or ([] if torch.cuda.is_available() else [128 << 20, 512 << 20])
    prefix = "cap" if torch.cuda.is_available() else "cpu"
    targets = [(f"{prefix}-{b >> 20}MiB", b) for b in budgets]
    if args.module:
        module, _, attribute = args.module.partition(":")
        factory = getattr(importlib.import_module(module), attribute or "make_step")
        if not targets:
            import gpuops

            room = gpuops.batch_size._headroom(torch.device("cuda"))  # as the C++ tool: minus a CUDA context
            targets = [(g["name"], g["memory_bytes"] - gpuops._C.CUDA_CONTEXT_BYTES) for g in gpuops.gpu_catalog()
                       if g["memory_bytes"] - gpuops._C.CUDA_CONTEXT_BYTES <= room]
        written = tune_python_module(factory, targets, args.out, args.steps, args.module, args.survive)
    else:
        if not BUILTIN.exists():
            sys.exit(f"{BUILTIN} is missing: run scripts/bootstrap --all (it builds the benchmarks)")
        command = [str(BUILTIN), "--out", str(args.out), "--steps", str(args.steps), *builtin_args]
        if budgets:
            command += ["--budgets", ",".join(f"{b >> 20}MiB" for b in budgets)]
        subprocess.run(command, check=True)
        written = [args.out / f"{name}.json" for name, _ in targets] if targets else sorted(args.out.glob("*.json"))
    write_figures(args.json, written)  # first: the plots need matplotlib, the figures do not
    print(f"wrote {render(written, args.docs)}")


def write_figures(path, written: List[Path]) -> None:
    """Per target: the largest batch, the trials it took and the steps it survived."""
    import results_json

    results = [json.loads(p.read_text()) for p in written]
    figures = {}
    for r in results:
        ooms = sum(not t["ok"] for t in r["trials"])
        kept = r.get("survived", {})
        figures[r["target"]] = (f"max batch {r['max_batch']}, {len(r['trials'])} trials ({ooms} OOM)"
                                + (f", {kept['ran']}/{kept['steps']} more steps ran" if kept.get("steps") else ""))
    results_json.write(path, "cuda" if torch.cuda.is_available() else "cpu", figures, results)


if __name__ == "__main__":
    main()
