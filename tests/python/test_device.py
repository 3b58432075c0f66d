"""gpuops.device_info: the CPU fallback, LOCAL_RANK and CUDA_VISIBLE_DEVICES handling."""

import os
import subprocess
import sys

import pytest
import torch

import gpuops
from conftest import requires_cuda


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)


def test_hidden_gpus_report_the_cpu():
    result = run_python(
        "import gpuops; d = gpuops.device_info(); print(d.type, d.visible_device_count, d.total_memory_bytes)",
        CUDA_VISIBLE_DEVICES="",
    )
    assert result.returncode == 0, result.stderr
    kind, count, total = result.stdout.split()
    assert (kind, count) == ("cpu", "0")
    assert int(total) == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_malformed_local_rank_is_a_value_error_naming_it():
    result = run_python("import gpuops; gpuops.device_info()", LOCAL_RANK="one")
    assert result.returncode != 0
    assert "ValueError" in result.stderr and "LOCAL_RANK" in result.stderr


def test_local_rank_is_reported():
    result = run_python("import gpuops; print(gpuops.device_info().local_rank)", LOCAL_RANK="0")
    assert result.stdout.strip() == "0"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_cpu_info_matches_the_machine():
    info = gpuops.device_info()
    assert info.type == "cpu"
    assert info.multiprocessors == os.cpu_count()
    assert 0 < info.free_memory_bytes <= info.total_memory_bytes
    assert info.compute_capability == (0, 0)


@requires_cuda
def test_cuda_info_matches_torch():
    info = gpuops.device_info(0)
    props = torch.cuda.get_device_properties(0)
    assert info.type == "cuda"
    assert info.name == props.name
    assert info.total_memory_bytes == props.total_memory
    assert info.multiprocessors == props.multi_processor_count
    assert info.compute_capability == (props.major, props.minor)
    free, total = torch.cuda.mem_get_info(0)
    assert info.free_memory_bytes == pytest.approx(free, rel=0.05)
