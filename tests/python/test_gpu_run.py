"""scripts/gpu-run: the rehearsal runs every checklist step here with CUDA absent (so that the script cannot rot
between GPU runs), and the runner's own rules hold: time budgets skip and name what does not fit, a step past
its time is stopped, a failed build skips what needs it, the summary says all of it, and docs/gpu-run.md holds
the step table the script prints."""

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import gpuops

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-run"
_loader = importlib.machinery.SourceFileLoader("gpu_run", str(SCRIPT))  # a script without .py: load it by hand
gpu_run = importlib.util.module_from_spec(importlib.util.spec_from_loader("gpu_run", _loader))
sys.modules["gpu_run"] = gpu_run  # its dataclasses look their module up there
_loader.exec_module(gpu_run)


def test_the_rehearsal_runs_every_checklist_step(tmp_path):
    """Every step passes here: the packaging (scripts/gpu-deps, under 64 MiB), the GPU build configured against
    carry/ alone, the C++ and Python CUDA suites (their CUDA cases skip), every benchmark and check on the CPU."""
    result = subprocess.run([sys.executable, str(SCRIPT), "--rehearse", "--out", str(tmp_path)], capture_output=True,
                            text=True, timeout=1200, env={k: v for k, v in os.environ.items() if k != "GPUOPS_GPU_STEPS"})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    steps = {s["name"]: s for s in summary["steps"]}
    assert {s["checklist"] for s in steps.values()} == set(range(8))  # preparation and checklist items 1-7
    assert all(s["status"] == "passed" for s in steps.values()), {n: s["status"] for n, s in steps.items()}
    figures = {n: s["figures"] for n, s in steps.items()}
    assert figures["pytest"]["tests"] >= 90 and figures["pytest"]["skipped"] == figures["pytest"]["tests"]
    assert figures["ctest"]["tests"] >= 5 and figures["memcheck"]["tests"] >= 3
    assert figures["zero"]["passed"] >= 10 and figures["zero"]["failed"] == 0
    assert figures["build"]["compile jobs"] > 10 and figures["package"]["carry MiB"] > 1
    assert figures["estimator"]["cases"] == "2 measured, 0 failed" and "batch 0," not in str(figures["batch_search"])
    markdown = (tmp_path / "summary.md").read_text()
    assert "rehearsal" in markdown and all(f"| {name} |" in markdown for name in steps)
    with tarfile.open(tmp_path / "logs.tar.gz") as tar:
        assert {f"logs/{name}.log" for name in steps} <= set(tar.getnames())
    assert len(list(tmp_path.iterdir())) <= 8  # the device tool returns at most 8 files from $OUT
    with pytest.raises(ValueError, match="rehearsal without a GPU"):  # no figure from a CPU passes for a GPU's
        gpuops.estimate("gpt2", device_profile=tmp_path / "device-profile.json")


def _context(tmp_path, rehearse=True):
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    return gpu_run.Context(rehearse, sys.executable, work, out, tmp_path / "deps")


def _step(name, expected_s, code="pass", needs_build=False, checklist=1):
    return gpu_run.Step(name, checklist, expected_s, f"{name} does {code}",
                        lambda c: [[sys.executable, "-c", code]], needs_build=needs_build)


@pytest.fixture
def quiet_machine(monkeypatch):
    monkeypatch.setattr(gpu_run, "machine", lambda c: {"mode": "test", "date": "today", "gpu": "none", "torch": "-",
                                                        "nvcc": "-", "compute_sanitizer": "-", "cpus": 1,
                                                        "commit": "-"})


def test_a_step_the_time_left_does_not_cover_is_skipped_and_named_for_a_second_call(tmp_path, quiet_machine):
    steps = [_step("first", 1), _step("big", 1000), _step("last", 1)]
    summary = gpu_run.run(_context(tmp_path, rehearse=False), ["first", "big", "last"], 60, steps)
    assert [s["status"] for s in summary["steps"]] == ["passed", "skipped: needs 1000 s, 60 s left", "passed"]
    assert summary["rerun"] == "big"
    assert 'GPUOPS_GPU_STEPS="big"' in (tmp_path / "out" / "summary.md").read_text()


def test_a_step_past_its_time_is_stopped_and_the_rest_still_run(tmp_path, quiet_machine, monkeypatch):
    monkeypatch.setattr(gpu_run, "SLACK_S", 0.0)  # stopped at twice its budget: 2 s
    steps = [_step("hangs", 1, "import time; time.sleep(60)"), _step("after", 0)]
    summary = gpu_run.run(_context(tmp_path, rehearse=False), ["hangs", "after"], 30, steps)
    assert [s["status"] for s in summary["steps"]] == ["timeout", "passed"]
    assert summary["steps"][0]["seconds"] < 20
    assert "stopped after" in (tmp_path / "work" / "hangs.log").read_text()


def test_a_failed_build_skips_the_steps_that_need_it(tmp_path, quiet_machine):
    steps = [_step("build", 1, "raise SystemExit(3)"), _step("uses_it", 1, needs_build=True),
             _step("standalone", 1), _step("not_asked", 1)]
    summary = gpu_run.run(_context(tmp_path), ["build", "uses_it", "standalone"], 60, steps)
    assert [s["status"] for s in summary["steps"]] == ["failed", "skipped: the build failed", "passed",
                                                       "not selected"]
    assert "exit status 3" in (tmp_path / "work" / "build.log").read_text()


def test_on_the_gpu_machine_a_step_without_a_build_says_so(tmp_path, quiet_machine, monkeypatch):
    monkeypatch.setattr(gpu_run.Context, "site", property(lambda c: tmp_path / "no-site"))
    summary = gpu_run.run(_context(tmp_path, rehearse=False), ["uses_it"], 60, [_step("uses_it", 1, needs_build=True)])
    assert summary["steps"][0]["status"].startswith("skipped: no build in")


def test_unknown_step_names_are_refused(monkeypatch, capsys):
    monkeypatch.setenv("GPUOPS_GPU_STEPS", "ctest nonsense")
    assert gpu_run.main(["--rehearse"]) == 2
    assert "nonsense" in capsys.readouterr().err


def test_the_steps_fit_the_deadline_and_cover_the_checklist():
    assert sum(s.expected_s for s in gpu_run.STEPS) <= gpu_run.DEADLINE_S
    assert {s.checklist for s in gpu_run.STEPS} == set(range(8))
    assert {"test_cuda_amp_step.py", "test_optim.py", "test_torch_scaler_suite.py"} <= set(gpu_run.cuda_suites())


def test_the_docs_hold_the_scripts_step_table():
    assert gpu_run.list_steps() in (ROOT / "docs" / "gpu-run.md").read_text()


def test_a_program_that_is_not_there_fails_its_step(tmp_path, quiet_machine):
    missing = gpu_run.Step("missing", 1, 1, "-", lambda c: [["/nonexistent/program"]], needs_build=False)
    summary = gpu_run.run(_context(tmp_path), ["missing"], 60, [missing])
    assert summary["steps"][0]["status"] == "failed"
    assert "cannot start /nonexistent/program" in (tmp_path / "work" / "missing.log").read_text()
