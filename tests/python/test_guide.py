"""docs/guide.md runs as written: each Python block in a fresh process (the ZeRO one under torchrun, then resumed
on another world size), each command, and its C++ block is examples/cpp/quickstart.cpp (built and run by
test_find_package.py)."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDE = (ROOT / "docs" / "guide.md").read_text()


def blocks(language):
    return re.findall(rf"^```{language}\n(.*?)^```$", GUIDE, re.S | re.M)


def run_python(code, cwd, *launcher):
    result = subprocess.run([sys.executable, *launcher, "-c", code] if not launcher else
                            [sys.executable, *launcher, str(cwd / "train.py")], cwd=cwd, capture_output=True,
                            text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


PLAIN = [code for code in blocks("python") if "init_process_group" not in code]


@pytest.mark.parametrize("index", range(len(PLAIN)))
def test_each_python_block_runs(index, tmp_path):
    out = run_python(PLAIN[index], tmp_path)
    if "TrainingState" in PLAIN[index]:  # a second run resumes where the first stopped
        assert "starting at step 0" in out and "stopped at step 50" in out
        again = run_python(PLAIN[index], tmp_path)
        assert "starting at step 50" in again and "stopped at step 50" in again


def test_the_sharded_block_trains_under_torchrun_and_resumes_on_another_world_size(tmp_path):
    (code,) = [code for code in blocks("python") if "init_process_group" in code]
    (tmp_path / "train.py").write_text(code)
    torchrun = ["-m", "torch.distributed.run", "--standalone"]
    assert "trained steps 0-9 on 2 process(es)" in run_python(code, tmp_path, *torchrun, "--nproc_per_node", "2")
    assert "trained steps 10-19 on 1 process(es)" in run_python(code, tmp_path, *torchrun, "--nproc_per_node", "1")


def test_each_command_runs():
    commands = [line.split("#")[0].strip() for block in blocks("bash") for line in block.splitlines()]
    commands = [c for c in commands if c]
    assert len(commands) >= 2
    for command in commands:
        argv = shlex.split(command)
        assert argv[0] == ".venv/bin/gpuops"
        result = subprocess.run([str(Path(sys.executable).parent / "gpuops"), *argv[1:]], capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, (command, result.stderr)


def test_the_cpp_block_is_the_quickstart_example():
    (code,) = blocks("cpp")
    assert code == (ROOT / "examples" / "cpp" / "quickstart.cpp").read_text()
