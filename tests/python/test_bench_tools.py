"""bench/tune_batch_size.py runs end to end (built-in LibTorch model and a Python module) on small CPU
budgets: JSON results, the Markdown table and the plots."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import gpuops

ROOT = Path(__file__).resolve().parents[2]


def make_step(device):
    """The --module factory used below: an MLP training step."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32)).to(device)
    optimizer = gpuops.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch):
        optimizer.zero_grad(set_to_none=True)
        model(torch.randn(batch, 32, device=device)).square().mean().backward()
        optimizer.step()

    return step


def run_tool(tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "tune_batch_size.py"), "--out", str(tmp_path / "out"),
                             "--docs", str(tmp_path / "docs"), "--steps", "1", *args],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = (tmp_path / "docs" / "batch_tuning.md").read_text()
    return table, {p.stem: json.loads(p.read_text()) for p in (tmp_path / "out").glob("*.json")}


def check(results, table, tmp_path):
    for name, r in results.items():
        assert r["max_batch"] >= 1 and r["trials"] and r["throughput"][-1]["batch"] == r["max_batch"]
        assert all(p["peak_bytes"] <= r["limit_bytes"] for p in r["throughput"])
        assert f"| {name} |" in table
        assert (tmp_path / "docs" / "batch_tuning" / f"{name}.png").stat().st_size > 1000


def test_tuning_tool_with_the_builtin_libtorch_model(tmp_path):
    table, results = run_tool(tmp_path, "--budgets", "24MiB,40MiB", "--layers", "1", "--width", "64", "--sequence", "32")
    assert set(results) == {"cpu-24MiB", "cpu-40MiB"}
    assert results["cpu-24MiB"]["max_batch"] < results["cpu-40MiB"]["max_batch"]
    check(results, table, tmp_path)


def test_tuning_tool_with_a_python_module(tmp_path):
    table, results = run_tool(tmp_path, "--module", "test_bench_tools:make_step", "--budgets", "1MiB")
    assert set(results) == {"cpu-1MiB"}
    check(results, table, tmp_path)
