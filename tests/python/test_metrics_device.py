"""gpuops.metrics.Recorder's GPU figures (issue 34, item 4: C++ DeviceMonitor, NVML loaded at run time on a
thread of its own). Without a GPU, a stand-in NVML with known answers (tests/cpp/fake_nvml.cpp, compiled here)
checks what the records, the CSV and the Prometheus page hold; without NVML they are not reported (None) and
nothing fails.
On a GPU the figures are checked against nvidia-smi --query-gpu, as GPU monitors show them."""

import json
import os
import shutil
import subprocess
import urllib.request

import pytest
import torch

import gpuops
from conftest import requires_cuda

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
FIGURES = ["gpu_util_pct", "gpu_memory_used_bytes", "gpu_temperature_c", "gpu_power_w", "gpu_sm_clock_mhz",
           "gpu_energy_j", "joules_per_token"]


@pytest.fixture
def fake_nvml(tmp_path, monkeypatch):
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler to build the stand-in NVML")
    library = tmp_path / "libfake_nvml.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), os.path.join(ROOT, "tests", "cpp",
                                                                                    "fake_nvml.cpp")], check=True)
    monkeypatch.setenv("GPUOPS_NVML_LIBRARY", str(library))
    return library


def test_records_the_csv_and_prometheus_hold_the_gpu_figures(fake_nvml, tmp_path):
    records = []
    recorder = gpuops.metrics.Recorder(log_every=2, csv=str(tmp_path / "m.csv"), callback=records.append,
                                       device_monitor="00000000:3B:00.0", device_monitor_s=3600,
                                       prometheus_port=0)
    for _ in range(4):
        recorder.step_done(torch.tensor(1.0), tokens=250)
    page = urllib.request.urlopen(f"http://127.0.0.1:{recorder.prometheus_port}/metrics", timeout=10).read().decode()
    recorder.close()
    assert len(records) == 2
    for r in records:  # the stand-in's answers: 150 W, 1410 MHz, 2 J per reading (two readings per record)
        assert r["gpu_power_w"] == 150 and r["gpu_sm_clock_mhz"] == 1410
        assert r["gpu_energy_j"] == 2 and r["joules_per_token"] == 2 / 500
        assert r["gpu_memory_used_bytes"] > 2**30 and 10 <= r["gpu_util_pct"] <= 90
    assert "gpu_power_w" in page and "joules_per_token" in page
    header = (tmp_path / "m.csv").read_text().splitlines()[0].split(",")
    assert all(f in header for f in FIGURES)


def test_without_nvml_the_figures_are_nan_and_nothing_fails(monkeypatch):
    monkeypatch.setenv("GPUOPS_NVML_LIBRARY", "/nonexistent/libnvidia-ml.so.1")
    records = []
    recorder = gpuops.metrics.Recorder(log_every=1, callback=records.append, device_monitor="0")
    recorder.step_done(torch.tensor(1.0), tokens=8)
    recorder.close()
    assert all(records[0][f] is None for f in FIGURES)  # (NaN: not reported)
    if not torch.cuda.is_available():  # "auto" without CUDA monitors nothing
        records.clear()
        recorder = gpuops.metrics.Recorder(log_every=1, callback=records.append)
        recorder.step_done(torch.tensor(1.0))
        recorder.close()
        assert all(records[0][f] is None for f in FIGURES)  # (NaN: not reported)
    with pytest.raises(ValueError, match="gpu_sample_s"):
        gpuops.metrics.Recorder(device_monitor="0", device_monitor_s=0)
    with pytest.raises(TypeError, match="device_monitor must be"):
        gpuops.metrics.Recorder(device_monitor=1.5)


@requires_cuda
@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs nvidia-smi")
def test_cuda_figures_agree_with_nvidia_smi():
    """The memory in use and the temperature as nvidia-smi reports them for the same GPU, read right after."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB more in use during the interval
    records = []
    recorder = gpuops.metrics.Recorder(log_every=1, callback=records.append, device_monitor_s=0.05)
    recorder.step_done(torch.tensor(1.0, device="cuda"), tokens=1000)
    recorder.close()
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    bus = f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    smi = subprocess.run(["nvidia-smi", f"--id={bus}", "--query-gpu=memory.used,temperature.gpu,clocks.sm",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True).stdout
    used_mib, temperature, _clock = (float(v) for v in smi.strip().split(","))
    r = records[0]
    print(json.dumps({f: r[f] for f in FIGURES}), "nvidia-smi:", smi.strip())
    assert abs(r["gpu_memory_used_bytes"] / 2**20 - used_mib) <= 64, (r["gpu_memory_used_bytes"], used_mib)
    assert abs(r["gpu_temperature_c"] - temperature) <= 3
    assert r["gpu_power_w"] > 0 and 0 <= r["gpu_util_pct"] <= 100
    del x
