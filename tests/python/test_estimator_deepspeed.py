"""DeepSpeed ZeRO-3's gradient bucket (zero 3, sharding flat): reduce_bucket_size elements of the model's 16-bit
dtype made at setup (runtime/zero/stage3.py, _setup_for_real_optimizer), alive through every moment of the step
(docs/estimator.md, "DeepSpeed ZeRO-3's own buffers"); "auto" is Hugging Face's hidden_size**2; 0 is
contiguous_gradients off. Bad values and other layouts are refused naming the option."""

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
    assert some.gradients - none.gradients == elements * element_bytes
    assert some.allocated_peak - none.allocated_peak == pytest.approx(elements * element_bytes, abs=2**21)
    assert some.peak_phase == none.peak_phase


def test_auto_is_hidden_size_squared_and_the_default_is_deepspeeds():
    none = gpuops.estimate("llama-2-7b", ds_reduce_bucket=0, **SETUP)
    auto = gpuops.estimate("llama-2-7b", ds_reduce_bucket="auto", **SETUP)
    default = gpuops.estimate("llama-2-7b", **SETUP)
    assert auto.gradients - none.gradients == 4096 * 4096 * 2
    assert default.gradients - none.gradients == 500_000_000 * 2


def test_the_command_line_gives_the_same_bytes():
    out = subprocess.run([sys.executable, "-m", "gpuops", "estimate", "--model", "llama-2-7b", "--zero", "3", "--gpus", "8", "--batch", "2",
                          "--seq", "1024", "--gpu", "H100-80GB", "--ds-reduce-bucket", "auto", "--json"],
                         capture_output=True, text=True, check=True).stdout
    run = json.loads(out)["runs"][0]
    assert run["setup"]["ds_reduce_bucket"] == "auto"
    assert run["breakdown"]["gradients"] == gpuops.estimate("llama-2-7b", ds_reduce_bucket="auto", **SETUP).gradients


@pytest.mark.parametrize("value, message", [(-5, "ds-reduce-bucket -5 is not accepted"),
                                            ("many", "ds-reduce-bucket 'many' is not accepted; accepted: auto")])
def test_bad_values_are_refused_naming_the_option(value, message):
    with pytest.raises(ValueError, match=message):
        gpuops.estimate("llama-2-7b", ds_reduce_bucket=value, **SETUP)


@pytest.mark.parametrize("other", [dict(zero_stage=2), dict(sharding="fsdp2")])
def test_other_layouts_refuse_it(other):
    setup = {**SETUP, **other}
    with pytest.raises(ValueError, match="ds-reduce-bucket is DeepSpeed's ZeRO-3 reduce_bucket_size"):
        gpuops.estimate("llama-2-7b", ds_reduce_bucket=10**8, **setup)
    gpuops.estimate("llama-2-7b", **setup)  # the default is accepted everywhere
