"""gpuops.estimate and the `gpuops` console script, from Python."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import gpuops

GPUOPS = str(Path(sys.executable).parent / "gpuops")


def run(*args):
    return subprocess.run([GPUOPS, *args], capture_output=True, text=True, timeout=120)


def test_preset_parameter_counts_match_the_hugging_face_model_built_from_the_same_config():
    config = transformers.LlamaConfig(vocab_size=3000, hidden_size=192, intermediate_size=512, num_hidden_layers=3,
                                      num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    spec = gpuops._C.model_from_config_json(json.dumps(config.to_dict()), "tiny-llama")
    assert spec.parameter_count == sum(p.numel() for p in model.parameters())

    gpt2 = transformers.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=1000, n_positions=256)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(gpt2)
    spec = gpuops._C.model_from_config_json(json.dumps(gpt2.to_dict()), "tiny-gpt2")
    assert spec.parameter_count == sum(p.numel() for p in model.parameters())


def test_estimate_breakdown_adds_up_and_reacts_to_the_setup():
    base = gpuops.estimate("llama-2-7b", precision="bf16-mixed", micro_batch=1, seq_len=1024)
    assert base.total_bytes == sum(base.byte_items().values()) == base.as_dict()["total"]
    assert base.peak_phase in {"loss-backward", "attention-backward", "backward-end", "optimizer-step"}
    more = gpuops.estimate("llama-2-7b", precision="bf16-mixed", micro_batch=4, seq_len=1024)
    lora = gpuops.estimate("llama-2-7b", precision="bf16-mixed", micro_batch=1, seq_len=1024, lora_rank=8)
    zero3 = gpuops.estimate("llama-2-7b", precision="bf16-mixed", micro_batch=1, seq_len=1024, zero_stage=3, num_gpus=8)
    assert more.activations > 3 * base.activations
    assert lora.optimizer_states < base.optimizer_states / 100
    assert zero3.weights * 8 == pytest.approx(base.weights, rel=1e-6)
    cpu = gpuops.estimate("llama-2-7b", device="cpu")
    assert cpu.cuda_context == 0 and cpu.allocator_slack == 0


def test_amp_layout_and_optimizer_implementation_move_the_bytes():
    autocast = gpuops.estimate("llama-2-7b", precision="bf16-mixed", amp="autocast", device="cpu")
    master = gpuops.estimate("llama-2-7b", precision="bf16-mixed", amp="master-copy", device="cpu")
    params = gpuops._C.model_from_preset("llama-2-7b").parameter_count
    assert autocast.master_weights == 0 and master.master_weights == 4 * params
    assert master.weights < autocast.weights  # 16-bit weights instead of fp32
    kwargs = dict(model="llama-2-7b", precision="bf16-mixed", micro_batch=1, seq_len=128)
    foreach = gpuops.estimate(optimizer_impl="foreach", **kwargs)
    fused = gpuops.estimate(optimizer_impl="fused", **kwargs)
    assert foreach.peak_phase == "optimizer-step" and foreach.temporaries == 4 * params
    assert fused.total_bytes < foreach.total_bytes


@pytest.mark.parametrize("kwargs, match", [
    ({"model": "gpt2", "amp": "apex"}, "amp"),
    ({"model": "gpt2", "precision": "fp32", "amp": "master-copy"}, "amp"),
    ({"model": "gpt2", "optimizer_impl": "turbo"}, "optimizer-impl"),
    ({"model": "gpt2", "attention": "xformers"}, "attention"),
    ({"model": "llama-9"}, "model|preset"),
    ({"model": "gpt2", "micro_batch": 0}, "batch"),
    ({"model": "gpt2", "zero_stage": 4}, "zero"),
    ({"model": "gpt2", "lora_rank": 10_000}, "rank"),
    ({"model": "gpt2", "precision": "fp8"}, "precision"),
    ({"model": "gpt2", "device": "tpu"}, "device"),
    ({}, "exactly one"),
    ({"model": "gpt2", "params": "7B"}, "exactly one"),
])
def test_bad_input_is_a_value_error_naming_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=f"(?i){match}"):
        gpuops.estimate(**kwargs)


def test_config_file_and_dict_give_the_same_estimate(tmp_path):
    config = transformers.GPT2Config(n_embd=256, n_layer=4, n_head=8, vocab_size=5000).to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert gpuops.estimate(config=path, seq_len=128) == gpuops.estimate(config=config, seq_len=128)


def test_console_script_default_runs_and_json_is_machine_readable():
    default = run("estimate")
    assert default.returncode == 0, default.stderr
    assert "LoRA" in default.stdout and "full fine-tune" in default.stdout and "H100" in default.stdout
    as_json = run("estimate", "--model", "mistral-7b", "--batch", "2", "--seq", "1024", "--json")
    assert as_json.returncode == 0, as_json.stderr
    document = json.loads(as_json.stdout)
    run0 = document["runs"][0]
    python_total = gpuops.estimate("mistral-7b", micro_batch=2, seq_len=1024).total_bytes
    assert json.dumps(run0).count(str(python_total)) >= 1  # the CLI and the Python API agree


@pytest.mark.parametrize("args", [
    ["estimate", "--model", "nope"],
    ["estimate", "--model", "gpt2", "--batch", "-1"],
    ["estimate", "--model", "gpt2", "--zero", "7"],
    ["estimate", "--config", "/nonexistent/config.json"],
    ["estimate", "--model", "gpt2", "--lora-rank", "5000"],
    ["estimate", "--frobnicate"],
])
def test_console_script_bad_input_exits_2_with_one_line(args):
    result = run(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuops: error:"), result.stderr
    assert "Traceback" not in result.stderr


def test_gpus_lists_the_catalog():
    result = run("gpus", "--json")
    assert result.returncode == 0
    names = {row["name"] for row in json.loads(result.stdout)["gpus"]}
    assert {g["name"] for g in gpuops.gpu_catalog()} == names
