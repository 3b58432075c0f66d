"""DeepSpeed ZeRO-3 (zero 3, sharding flat): its gradient bucket, reduce_bucket_size elements of the model's 16-bit
dtype made at setup (runtime/zero/stage3.py, _setup_for_real_optimizer), alive through every moment of the step
(docs/estimator.md, "DeepSpeed ZeRO-3's own buffers"); "auto" is Hugging Face's hidden_size**2; 0 is
contiguous_gradients off. Bad values and other layouts are refused naming the option. And bitsandbytes'
quantisation statistics, which the partitions leave whole on every rank."""

import json
import random
import subprocess
import sys

import pytest

import gpuops

SETUP = dict(zero_stage=3, num_gpus=8, micro_batch=2, seq_len=1024, gpu="H100-80GB")


@pytest.mark.parametrize("precision, element_bytes", [("bf16-mixed", 2), ("fp32", 4)])
def test_the_bucket_is_its_elements_in_the_model_dtype_at_every_moment(precision, element_bytes):
    elements = random.randint(1, 10**9)
    none = gpuops.estimate("llama-2-7b", precision=precision, ds_reduce_bucket=0, **SETUP)
    some = gpuops.estimate("llama-2-7b", precision=precision, ds_reduce_bucket=elements, **SETUP)
    assert some.gradients - none.gradients == elements * element_bytes, elements
    assert some.allocated_peak - none.allocated_peak == pytest.approx(elements * element_bytes, abs=2**21), elements
    assert some.peak_phase == none.peak_phase


def test_auto_is_hidden_size_squared_and_the_default_is_deepspeeds():
    none = gpuops.estimate("llama-2-7b", ds_reduce_bucket=0, **SETUP)
    auto = gpuops.estimate("llama-2-7b", ds_reduce_bucket="auto", **SETUP)
    default = gpuops.estimate("llama-2-7b", **SETUP)
    assert auto.gradients - none.gradients == 4096 * 4096 * 2
    assert default.gradients - none.gradients == 500_000_000 * 2


def test_auto_needs_a_hidden_size():
    with pytest.raises(ValueError, match="ds-reduce-bucket auto is hidden_size squared"):
        gpuops.estimate(params="7B", ds_reduce_bucket="auto", **SETUP)


def test_5e8_is_accepted_as_deepspeed_configs_write_it():
    assert gpuops.estimate("llama-2-7b", ds_reduce_bucket="5e8", **SETUP) == gpuops.estimate("llama-2-7b", **SETUP)


def test_the_command_line_gives_the_same_bytes():
    out = subprocess.run([sys.executable, "-m", "gpuops", "estimate", "--model", "llama-2-7b", "--zero", "3", "--gpus", "8", "--batch", "2",
                          "--seq", "1024", "--gpu", "H100-80GB", "--ds-reduce-bucket", "auto", "--json"],
                         capture_output=True, text=True, check=True).stdout
    run = json.loads(out)["runs"][0]
    assert run["setup"]["ds_reduce_bucket"] == "auto"
    other = json.loads(subprocess.run([sys.executable, "-m", "gpuops", "estimate", "--model", "llama-2-7b", "--zero",
                                       "2", "--gpus", "8", "--json"], capture_output=True, text=True,
                                      check=True).stdout)["runs"][0]
    assert other["setup"]["ds_reduce_bucket"] is None  # not DeepSpeed ZeRO-3: no bucket
    assert run["breakdown"]["gradients"] == gpuops.estimate("llama-2-7b", ds_reduce_bucket="auto", **SETUP).gradients


@pytest.mark.parametrize("value, message", [(-5, "ds_reduce_bucket -5 is not accepted"),
                                            (-1, "ds_reduce_bucket -1 is not accepted; accepted: 'auto'"),
                                            ("many", "ds-reduce-bucket 'many' is not accepted; accepted: auto"),
                                            ("2.5", "ds-reduce-bucket '2.5' is not accepted"),
                                            ("2e12", "ds-reduce-bucket '2e12' is not accepted")])
def test_bad_values_are_refused_naming_the_option(value, message):
    with pytest.raises(ValueError, match=message):
        gpuops.estimate("llama-2-7b", ds_reduce_bucket=value, **SETUP)


@pytest.mark.parametrize("other", [dict(zero_stage=2), dict(sharding="fsdp2")])
def test_other_layouts_refuse_it(other):
    setup = {**SETUP, **other}
    with pytest.raises(ValueError, match="ds-reduce-bucket is DeepSpeed's ZeRO-3 reduce_bucket_size"):
        gpuops.estimate("llama-2-7b", ds_reduce_bucket=10**8, **setup)
    gpuops.estimate("llama-2-7b", **setup)  # the default is accepted everywhere


def _replicated_weight_bytes(base_dtype):
    """What every rank keeps whole of the weights: W(8) - (W(4) - W(8)) for per-rank weights W(N) = X / N + kept."""
    w = {n: gpuops.estimate("llama-2-7b", zero_stage=3, num_gpus=n, lora_rank=8, base_dtype=base_dtype,
                            gpu="A100-80GB").weights for n in (4, 8)}
    return 2 * w[8] - w[4]


@pytest.mark.parametrize("base_dtype", ["nf4", "nf4-nodq"])
def test_quantisation_statistics_stay_whole_on_every_rank(base_dtype):
    # bitsandbytes' absmax (and its double quantisation) are attributes of the weights, not parameters: the flat
    # partitions leave them whole. By hand for Llama-2-7B's 32 blocks: q, k, v, o 4096 x 4096, gate and up
    # 4096 x 11008, down 11008 x 4096; one absmax per 64 values (fp32, or 8-bit with an fp32 per 256 of them).
    sizes = [4096 * 4096] * 4 + [4096 * 11008] * 3
    per_block = sum((-(-n // 64) + 4 * -(-n // (64 * 256))) if base_dtype == "nf4" else 4 * -(-n // 64)
                    for n in sizes)
    expected = 32 * per_block
    kept = _replicated_weight_bytes(base_dtype) - _replicated_weight_bytes("bf16")
    assert kept == pytest.approx(expected, abs=64), (kept, expected)  # the ceilings of the shards: a few bytes
