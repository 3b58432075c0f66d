"""find_package(gpuops) works from another CMake project against the pip-installed package."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import gpuops
from test_examples import check_preempted_run_resumes_exactly

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
def test_examples_build_against_the_installed_package(tmp_path):
    build = ROOT / "build" / "examples"  # kept between runs: a rerun rebuilds nothing
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    configure = subprocess.run(
        ["cmake", "-S", str(ROOT / "examples" / "cpp"), "-B", str(build), "-G", "Ninja",
         "-DCMAKE_BUILD_TYPE=Release", f"-DCMAKE_PREFIX_PATH={gpuops.cmake_prefix_path}",
         f"-DPython3_EXECUTABLE={sys.executable}"],
        capture_output=True, text=True, env=env)
    assert configure.returncode == 0, configure.stdout[-3000:] + configure.stderr[-3000:]
    assert str(Path(gpuops.cmake_prefix_path).resolve()) in (build / "CMakeCache.txt").read_text()
    built = subprocess.run(["cmake", "--build", str(build)], capture_output=True, text=True, env=env)
    assert built.returncode == 0, built.stdout[-5000:] + built.stderr[-3000:]
    ran = subprocess.run([str(build / "fit_check")], capture_output=True, text=True, env=env, timeout=300)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "measured peak" in ran.stdout and "estimated" in ran.stdout
    # The C++ AMP loop (AutocastGuard + GradScaler + fused AdamW + a torch scheduler) trains: it exits 0
    # only when the loss went down.
    trained = subprocess.run([str(build / "train_amp"), "30"], capture_output=True, text=True, env=env, timeout=300)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert "loss" in trained.stdout
    # The C++ fine-tuning loop (checkpointing, accumulation, TrainingState) survives a preemption.
    check_preempted_run_resumes_exactly(
        lambda folder, steps, *stop_at: [str(build / "finetune"), str(folder), str(steps), *map(str, stop_at)],
        tmp_path)
    # docs/guide.md's C++ program: a second run resumes after the last save instead of starting over.
    first, second = (subprocess.run([str(build / "quickstart"), str(tmp_path / "quick")], capture_output=True,
                                    text=True, env=env, timeout=300) for _ in range(2))
    assert first.returncode == 0 and "step 49 loss" in first.stdout and "done at step 50" in first.stdout, first
    assert second.returncode == 0 and second.stdout == "done at step 50\n", second


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
def test_the_readme_recipe_configures_with_a_clean_path(tmp_path):
    """The README's C++ recipe as a new user runs it: no venv on PATH, no Python hint. The package finds the
    LibTorch gpuops was built against (beside it in site-packages), not whatever Python is on PATH."""
    import torch.utils

    clean = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8"}
    configure = subprocess.run(
        [shutil.which("cmake"), "-S", str(ROOT / "examples" / "cpp"), "-B", str(tmp_path / "build"), "-G", "Ninja",
         f"-DCMAKE_MAKE_PROGRAM={shutil.which('ninja')}", f"-DCMAKE_PREFIX_PATH={gpuops.cmake_prefix_path}"],
        capture_output=True, text=True, env=clean, cwd=tmp_path)
    assert configure.returncode == 0, configure.stdout[-3000:] + configure.stderr[-3000:]
    cache = (tmp_path / "build" / "CMakeCache.txt").read_text()
    library = next(line.split("=", 1)[1] for line in cache.splitlines() if line.startswith("TORCH_LIBRARY:"))
    torch_root = Path(torch.utils.cmake_prefix_path).parents[1]  # .../site-packages/torch
    assert Path(library).resolve().is_relative_to(torch_root.resolve()), library


@pytest.mark.parametrize("stage", [2, 3])
def test_cpp_zero_example_resumes_at_another_world_size(tmp_path, stage):
    """examples/cpp/train_zero.cpp (built by the test above) as 2 processes with torchrun-style variables:
    preempted by a SIGTERM on rank 1 (both save the same step, exit 0), resumed as 1 process (resharded);
    stage 3 through ShardedSequential."""
    from multiprocess_launch import free_port
    from test_examples import check_zero_resume_at_another_world_size

    program = ROOT / "build" / "examples" / "train_zero"
    if not program.exists():
        pytest.skip("the examples were not built (test_examples_build_against_the_installed_package)")

    def run(folder, world, *extra):
        base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
                    OMP_NUM_THREADS="1")
        args = [str(tmp_path / folder), "16", *(extra or ["-1"]), str(stage)]
        procs = [subprocess.Popen([str(program), *args], env=dict(base, RANK=str(r)),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
        outs = [p.communicate(timeout=300)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), outs
        return outs[0]

    check_zero_resume_at_another_world_size(run, ["6"], lambda folder: tmp_path / folder)
