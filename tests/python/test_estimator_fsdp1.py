"""sharding="fsdp1": torch's FullyShardedDataParallel with FULL_SHARD. The weights, gradients and states in
DeepSpeed's flat partitions without DeepSpeed's gradient bucket; the root unit gathered through the backward (the
moments themselves are checked in C++, SetupsState.Fsdp2UnshardedBuffersAndReshardAfterForward). Options that
FSDP1 has no counterpart for are refused naming them."""

import json
import random
import subprocess
import sys

import pytest

import gpuops


def setup(**extra):
    return dict(num_gpus=random.choice([2, 4, 8]), micro_batch=random.randint(1, 4), seq_len=random.choice([512, 2048]),
                gpu="A100-80GB", lora_rank=random.choice([0, 16]), **extra)


def test_the_state_is_deepspeeds_flat_partitions_without_its_bucket():
    s = setup()
    fsdp1 = gpuops.estimate("llama-2-7b", sharding="fsdp1", **s)
    deepspeed = gpuops.estimate("llama-2-7b", zero_stage=3, ds_reduce_bucket=0, **s)
    assert (fsdp1.weights, fsdp1.optimizer_states) == (deepspeed.weights, deepspeed.optimizer_states), s
    if fsdp1.peak_phase == deepspeed.peak_phase:  # (the gradients are those alive at the peak)
        assert fsdp1.gradients == deepspeed.gradients, s
    assert gpuops.estimate("llama-2-7b", sharding="fsdp1", zero_stage=3, **s) == fsdp1  # zero 0 means 3


def test_the_root_unit_is_gathered_at_the_loss_moment():
    # At the loss's backward FSDP1 holds the root (embeddings, final norm, head: 2 x 32000 x 4096 + 4096 16-bit
    # values of Llama-2-7B) and the last block its root prefetched; DeepSpeed the head (32000 x 4096) and two blocks
    # (4 x 4096^2 + 3 x 4096 x 11008 + 2 x 4096 each).
    s = {**setup(precision="bf16"), "seq_len": 2048}
    fsdp1 = gpuops.estimate("llama-2-7b", sharding="fsdp1", **s)
    deepspeed = gpuops.estimate("llama-2-7b", zero_stage=3, ds_reduce_bucket=0, **s)
    assert fsdp1.peak_phase == deepspeed.peak_phase == "loss-backward", s
    root, head, block = (2 * 32000 * 4096 + 4096) * 2, 32000 * 4096 * 2, (4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096) * 2
    assert fsdp1.temporaries - deepspeed.temporaries == (root + block) - (head + 2 * block), s


@pytest.mark.parametrize("option, message", [
    (dict(zero_stage=2), "sharding fsdp1 is FSDP1's FULL_SHARD \\(ZeRO stage 3\\); accepted: zero 3"),
    (dict(ds_reduce_bucket=10**8), "ds-reduce-bucket is DeepSpeed's ZeRO-3 reduce_bucket_size"),
    (dict(offload_optimizer=True), "FSDP's CPU offload also offloads the parameters"),
    (dict(reshard_after_forward=False), "reshard-after-forward false applies to sharding fsdp2 and gpuops only"),
])
def test_what_fsdp1_has_no_counterpart_for_is_refused(option, message):
    with pytest.raises(ValueError, match=message):
        gpuops.estimate("llama-2-7b", sharding="fsdp1", num_gpus=2, **option)


def test_the_command_line_names_it():
    out = subprocess.run([sys.executable, "-m", "gpuops", "estimate", "--model", "llama-2-7b", "--sharding", "fsdp1",
                          "--gpus", "4", "--json"], capture_output=True, text=True, check=True).stdout
    run = json.loads(out)["runs"][0]
    assert run["setup"]["sharding"] == "fsdp1" and run["setup"]["zero_stage"] == 3
    assert run["setup"]["ds_reduce_bucket"] is None
    assert run["breakdown"]["weights"] == gpuops.estimate("llama-2-7b", sharding="fsdp1", num_gpus=4).weights
    text = subprocess.run([sys.executable, "-m", "gpuops", "estimate", "--model", "llama-2-7b", "--sharding", "fsdp1",
                           "--gpus", "4"], capture_output=True, text=True, check=True).stdout
    assert "FSDP1 FULL_SHARD" in text
