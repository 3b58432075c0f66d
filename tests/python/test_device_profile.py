"""Measured device profiles (device-profile.json, written by bench/estimator_validation/calibrate_device.py on a
GPU): `gpuops estimate --device-profile` and estimate(device_profile=) put the measured CUDA context and
workspaces in place of the table's for GPUs of the profile's compute capability, and refuse a file that is not
one, naming the argument and the field. Also the caching allocator model's replay, which that script compares
with torch's allocator."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

import gpuops

MiB = 1 << 20
GPUOPS = str(Path(sys.executable).parent / "gpuops")  # the native command line, beside the venv's python


def _profile(tmp_path, **changes):
    profile = {"format": "gpuops-device-profile", "version": 1, "gpu": "NVIDIA H100 80GB HBM3",
               "compute_capability": 90, "driver": "580.159.04", "torch": "2.11.0+cu130", "date": "2026-12-01",
               "context_bytes": random.randint(300, 900) * MiB, "workspace_bytes": random.randint(1, 200) * MiB,
               "details": {"context_per_case": [1, 2, 3]}}
    profile["context_low_bytes"] = profile["context_bytes"] - 20 * MiB
    profile["context_high_bytes"] = profile["context_bytes"] + 40 * MiB
    profile.update(changes)
    path = tmp_path / "device-profile.json"
    path.write_text(json.dumps({k: v for k, v in profile.items() if v is not None}))
    return path, profile


def test_the_measured_context_and_workspaces_replace_the_tables_on_gpus_of_its_compute_capability(tmp_path):
    path, p = _profile(tmp_path)
    # CUDA 12: the table's figures (under CUDA 13 the H200 run's profile is built in: test_estimator_profiles.py)
    table = gpuops.estimate("llama-2-7b", gpu="H100-80GB", cuda=12)
    measured = gpuops.estimate("llama-2-7b", gpu="H100-80GB", cuda=12, device_profile=path)
    assert measured.cuda_context == p["context_bytes"] and measured.workspaces == p["workspace_bytes"]
    assert table.cuda_context == 500 * MiB and table.workspaces == 66 * MiB
    rounded = lambda b: b.allocated_peak - b.block_rounding  # noqa: E731 (the workspaces' blocks round too)
    assert rounded(measured) - rounded(table) == p["workspace_bytes"] - 66 * MiB
    # the band follows the measured range (20 MiB below, 40 above), not the table's (200 either side); the rest
    # of the band (25% of the allocated bytes above, 10% below) is the same for both
    def asymmetry(b):  # what the allocated bytes' share adds above more than below
        return round(0.25 * b.allocated_peak) - round(0.10 * b.allocated_peak)
    assert measured.band_above - measured.band_below - asymmetry(measured) == 20 * MiB
    assert table.band_above - table.band_below == asymmetry(table)
    other = gpuops.estimate("llama-2-7b", gpu="A100-80GB", device_profile=path)  # sm_80: the table's
    assert other.cuda_context == gpuops.estimate("llama-2-7b", gpu="A100-80GB").cuda_context
    given = gpuops.estimate("llama-2-7b", gpu="H100-80GB", cuda=12, device_profile=path, context_bytes=123 * MiB)
    assert given.cuda_context == 123 * MiB and given.workspaces == p["workspace_bytes"]


def test_the_command_line_reads_it_and_says_where_the_figures_come_from(tmp_path):
    path, p = _profile(tmp_path)
    out = subprocess.run([GPUOPS, "estimate", "--model", "gpt2", "--device-profile", str(path), "--json"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    run = result["runs"][0] if "runs" in result else result
    assert run["breakdown"]["cuda_context"] == p["context_bytes"]
    text = subprocess.run([GPUOPS, "estimate", "--model", "gpt2", "--device-profile", str(path)],
                          capture_output=True, text=True).stdout
    assert "CUDA context measured on NVIDIA H100 80GB HBM3 (sm_90, driver 580.159.04" in text


@pytest.mark.parametrize("changes, message", [
    (dict(format="something"), "field 'format' is \"something\""),
    (dict(version=2), "field 'version' is 2; accepted: an integer 1 to 1"),
    (dict(compute_capability="90"), "field 'compute_capability' is \"90\""),
    (dict(compute_capability=7), "field 'compute_capability' is 7; accepted: an integer 50 to 130"),
    (dict(context_bytes=None), "field 'context_bytes' is missing"),
    (dict(context_bytes=-1), "field 'context_bytes' is -1"),
    (dict(context_bytes=1.5e9), "field 'context_bytes' is 1500000000.0"),
    (dict(context_low_bytes=10**12), "field 'context_low_bytes'"),
    (dict(context_high_bytes=1), "field 'context_high_bytes' is 1"),
    (dict(workspace_bytes=2**63 + 5), "field 'workspace_bytes'"),
    (dict(gpu=7), "field 'gpu' is 7; accepted: a string"),
    (dict(rehearsal=True), "was written by a rehearsal without a GPU"),
])
def test_a_file_that_is_not_a_measured_profile_is_refused_naming_the_field(tmp_path, changes, message):
    path, _ = _profile(tmp_path, **changes)
    with pytest.raises(ValueError, match="device_profile '.*device-profile.json'") as error:
        gpuops.estimate("gpt2", device_profile=path)
    assert message in str(error.value)
    out = subprocess.run([GPUOPS, "estimate", "--model", "gpt2", "--device-profile", str(path)], capture_output=True,
                         text=True)
    assert out.returncode == 2 and "--device-profile" in out.stderr and message in out.stderr


def test_paths_that_are_not_a_profile_are_refused(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    for path, message in [(tmp_path / "missing.json", "cannot be read"), (tmp_path, "is a directory"),
                          (tmp_path / "bad.json", "is not a JSON object"), (tmp_path / "list.json", "is not a JSON object")]:
        with pytest.raises(ValueError, match=message):
            gpuops.estimate("gpt2", device_profile=path)
    with pytest.raises(ValueError, match="holds a NUL byte"):  # open() would read the file before the NUL
        gpuops.estimate("gpt2", device_profile=str(tmp_path / "bad.json") + "\0.txt")
    with pytest.raises(ValueError, match="config '.*' holds a NUL byte"):  # the same reader as a config.json's
        gpuops.estimate(config=str(tmp_path / "bad.json") + "\0.txt")
    with pytest.raises(TypeError, match="device_profile must be a path or None"):
        gpuops.estimate("gpt2", device_profile=3)
    out = subprocess.run([GPUOPS, "estimate", "--model", "gpt2", "--device-profile", ""], capture_output=True, text=True)
    assert out.returncode == 2 and "--device-profile '' is not a file name" in out.stderr


def test_the_plot_and_the_advice_take_it_too(tmp_path):
    path, p = _profile(tmp_path)
    assert gpuops.estimate_svg("gpt2", gpu="H100-80GB", device_profile=path) != gpuops.estimate_svg("gpt2", gpu="H100-80GB")
    advice = gpuops.advise("H100-80GB", "llama-2-7b", device_profile=path)
    assert advice.total_bytes == gpuops.estimate("llama-2-7b", gpu="H100-80GB", device_profile=path).total_bytes


def test_the_allocator_model_replays_a_trace_by_c10s_rules():
    """Rounding to 512 bytes, 2 MiB small segments, 20 MiB segments for 1-10 MiB, larger ones rounded to 2 MiB;
    a freed block is reused."""
    replay = gpuops._C.replay_caching_allocator
    assert replay([1000]) == {"peak_allocated": 1024, "peak_reserved": 2 * MiB, "peak_requested": 1000}
    assert replay([3 * MiB])["peak_reserved"] == 20 * MiB
    assert replay([25 * MiB + 1])["peak_reserved"] == 26 * MiB
    assert replay([25 * MiB, -1, 25 * MiB])["peak_reserved"] == 26 * MiB  # the cached segment serves the second
    assert replay([25 * MiB, 25 * MiB])["peak_reserved"] == 52 * MiB
    assert replay([3 * MiB, 3 * MiB], expandable=True)["peak_reserved"] == 20 * MiB
    for bad in ([-1], [100, -2], [100, -1, -1], [0], [2**40 + 1], [2**63 - 1]):
        with pytest.raises(ValueError, match="trace: .* is not accepted"):
            replay(bad)
