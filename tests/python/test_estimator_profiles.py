"""The measured device profiles gpuops ships (builtin_measured_cuda in src/estimator/cuda_runtime_costs.cpp) are the
files the GPU runs wrote (bench/results/device-profile-*.json): the default estimate for that compute capability and
CUDA release gives the same context and workspaces as --device-profile with the file."""

import glob
import json
import os

import pytest

import gpuops

RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "results")
# A catalog GPU per compute capability measured.
GPU_OF = {90: "H100-80GB"}


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(RESULTS, "device-profile-*.json"))))
def test_the_built_in_profile_is_the_file(path):
    with open(path) as f:
        profile = json.load(f)
    cuda = int(profile["cuda"].split(".")[0])
    gpu = GPU_OF[profile["compute_capability"]]
    setup = dict(model="gpt2", gpu=gpu, cuda=cuda, micro_batch=2, seq_len=256)
    built_in = gpuops.estimate(**setup)
    from_file = gpuops.estimate(**setup, device_profile=path)
    assert built_in.cuda_context == from_file.cuda_context == profile["context_bytes"]
    assert built_in.workspaces == from_file.workspaces == profile["workspace_bytes"]
    # The range: the measured one widened to the table's low end (other drivers), so the band below is wider.
    assert built_in.band_above == from_file.band_above
    assert built_in.band_below > from_file.band_below


def test_other_cuda_releases_keep_the_table():
    assert gpuops.estimate("gpt2", gpu="H100-80GB", cuda=12).cuda_context == 500 * 2**20
    assert gpuops.estimate("gpt2", gpu="A100-80GB").cuda_context == 500 * 2**20
