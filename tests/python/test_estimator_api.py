"""gpuops.estimate and the `gpuops` console script, from Python."""

import dataclasses
import json
import os
import subprocess
import time
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
    params = gpuops._C.model_by_name("llama-2-7b").parameter_count
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


def cli_total(*args):
    result = run("estimate", "--json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["runs"][0]


@pytest.mark.parametrize("python, cli", [
    (dict(model="llama-3.2-1b", lora_rank=16), ["--model", "llama-3.2-1b", "--lora-rank", "16"]),
    (dict(model="gpt2"), ["--model", "gpt2"]),  # a learned position table of 1024: the default sequence is 1024
    (dict(model="tinyllama-1.1b", batch=3, seq=300, gpus=2, zero=2),
     ["--model", "tinyllama-1.1b", "--batch", "3", "--seq", "300", "--gpus", "2", "--zero", "2"]),
])
def test_python_and_the_command_line_give_the_same_estimate_with_the_same_defaults(python, cli):
    """One set of defaults and names (the CLI's spellings accepted from Python too): the same totals."""
    ours = gpuops.estimate(**python)
    theirs = cli_total(*cli)
    assert ours.total_bytes == theirs["breakdown"]["total"]
    assert ours.total_high == theirs["breakdown"]["total_high"]
    assert theirs["setup"]["seq_len"] == (1024 if python["model"] == "gpt2" else python.get("seq", 2048))


def test_each_command_line_spelling_is_its_long_name_and_not_both():
    pairs = [("micro_batch", "batch", 4), ("seq_len", "seq", 512), ("num_gpus", "gpus", 4), ("zero_stage", "zero", 1)]
    for long_name, short_name, value in pairs:
        extra = {"num_gpus": 4} if long_name == "zero_stage" else {}
        long_ = gpuops.estimate("llama-3.2-1b", **{long_name: value}, **extra)
        short = gpuops.estimate("llama-3.2-1b", **{short_name: value}, **extra)
        assert long_ == short != gpuops.estimate("llama-3.2-1b", **extra)
        with pytest.raises(TypeError, match=f"{long_name} and {short_name}"):
            gpuops.estimate("llama-3.2-1b", **{long_name: value, short_name: value})
    assert gpuops.estimate("gpt2", micro_batch=None) == gpuops.estimate("gpt2", micro_batch=1)  # None: the default


@pytest.mark.parametrize("python, cli", [
    (dict(), []),
    (dict(recommend=True, lora_rank=8), ["--recommend", "--lora-rank", "8"]),
    (dict(gpu="a100-80gb", micro_batch=2), ["--gpu", "a100-80gb", "--batch", "2"]),
])
def test_the_fit_table_from_python_is_the_command_lines(python, cli):
    rows = gpuops.fit_table("llama-3.2-1b", **python)
    theirs = cli_total("--model", "llama-3.2-1b", *cli)["gpus"]
    assert [dataclasses.asdict(r) for r in rows] == theirs
    assert rows and all(isinstance(r, gpuops.GpuFit) for r in rows)
    if python.get("recommend"):
        assert all(r.fits for r in rows)
        prices = [r.spot_price_usd_per_hour for r in rows]
        assert prices == sorted(prices)
    if "gpu" in python:
        assert len(rows) == 1 and rows[0].max_micro_batch >= 2
    fitting = [r for r in gpuops.fit_table("llama-3.2-1b") if r.fits and r.precision_supported]
    assert fitting and all(r.headroom_bytes == r.memory_bytes - r.total_high_bytes for r in fitting)


def test_a_pretrained_config_or_a_live_model_is_estimated_as_its_config_json():
    config = transformers.LlamaConfig(vocab_size=3000, hidden_size=192, intermediate_size=512, num_hidden_layers=3,
                                      num_attention_heads=6, num_key_value_heads=2)
    from_dict = gpuops.estimate(config=config.to_dict(), seq_len=256)
    assert gpuops.estimate(config, seq_len=256) == from_dict == gpuops.estimate(config=config, seq_len=256)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    assert gpuops.estimate(model, seq_len=256) == from_dict


def test_a_config_object_and_another_architecture_are_refused_together():
    config = transformers.LlamaConfig(vocab_size=3000, hidden_size=192, intermediate_size=512, num_hidden_layers=3,
                                      num_attention_heads=6, num_key_value_heads=2)
    for other in (dict(config={"model_type": "gpt2"}), dict(params=10**9)):
        with pytest.raises(ValueError, match="exactly one"):
            gpuops.estimate(config, **other)

    class PreTrainedConfig:  # transformers 5's spelling of the base class
        def to_json_string(self, use_diff=False):
            return json.dumps(config.to_dict())

    class Llama5Config(PreTrainedConfig):
        pass

    assert gpuops.estimate(Llama5Config(), seq_len=64) == gpuops.estimate(config, seq_len=64)


def test_any_other_module_trains_its_parameters_and_holds_its_buffers():
    """(tests/python/test_estimator_module.py checks the rest: frozen and integer tensors, the warning, the plot.)"""
    model = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.BatchNorm1d(20), torch.nn.Linear(20, 5))
    count = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())  # running statistics, an int64 counter
    with pytest.warns(gpuops.EstimateWarning):
        b = gpuops.estimate(model, precision="fp32")
    bare = gpuops.estimate(params=count, precision="fp32")
    assert (b.gradients, b.optimizer_states) == (bare.gradients, bare.optimizer_states)
    assert b.weights == bare.weights + buffers
    with pytest.raises(ValueError, match="exactly one"):
        gpuops.estimate(model, params=count)
    with pytest.raises(ValueError, match="model: the ReLU has no trainable"):
        gpuops.estimate(torch.nn.ReLU())


def test_an_error_names_the_type_not_the_whole_object():
    big = {f"key{i}": list(range(50)) for i in range(100)}
    with pytest.raises(TypeError) as error:
        gpuops.estimate(big)
    assert "dict" in str(error.value) and len(str(error.value)) < 200
    with pytest.raises(TypeError) as error:
        gpuops.estimate("gpt2", micro_batch=list(range(10_000)))
    assert "micro_batch" in str(error.value) and len(str(error.value)) < 300


def fake_hub_cache(root, repo_id, config, revision="0123abcd"):
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    old = repo / "snapshots" / "ffff0000"  # another revision, newer on disk: refs/main wins as from_pretrained's
    old.mkdir()
    (old / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))


def test_a_hub_id_is_read_from_the_local_hugging_face_cache_by_python_and_the_command_line(tmp_path, monkeypatch):
    config = transformers.LlamaConfig(vocab_size=3000, hidden_size=192, intermediate_size=512, num_hidden_layers=3,
                                      num_attention_heads=6, num_key_value_heads=2).to_dict()
    fake_hub_cache(tmp_path, "some-org/tiny-llama", config)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    ours = gpuops.estimate("some-org/tiny-llama", seq_len=128)
    assert ours == gpuops.estimate(config=config, seq_len=128)
    theirs = cli_total("--model", "some-org/tiny-llama", "--seq", "128")
    assert theirs["breakdown"]["total"] == ours.total_bytes
    assert any("local Hugging Face Hub cache" in note for note in theirs["notes"]), theirs["notes"]
    for missing in ("some-org/absent", "../escape", "a/b/c"):
        with pytest.raises(ValueError, match="not a preset .* nor a Hugging Face Hub id"):
            gpuops.estimate(missing)
        result = run("estimate", "--model", missing)
        assert result.returncode == 2 and str(tmp_path) in result.stderr


@pytest.mark.parametrize("ref", ["fifo", "device"])
def test_a_hub_cache_ref_that_is_no_file_is_not_read(tmp_path, monkeypatch, ref):
    """refs/main as a FIFO (the CLI hung) or a link to /dev/zero (4.2 GB read): not read, the newest snapshot is
    taken, at once. Through the command line, whose timeout would catch a hang."""
    config = transformers.LlamaConfig(vocab_size=3000, hidden_size=192, intermediate_size=512, num_hidden_layers=3,
                                      num_attention_heads=6, num_key_value_heads=2).to_dict()
    fake_hub_cache(tmp_path, "some-org/tiny-llama", config)
    main = tmp_path / "models--some-org--tiny-llama" / "refs" / "main"
    main.unlink()
    if ref == "fifo":
        os.mkfifo(main)
    else:
        main.symlink_to("/dev/zero")
    newest = {**config, "num_hidden_layers": 1}  # the other snapshot, newer on disk
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    began = time.monotonic()
    got = cli_total("--model", "some-org/tiny-llama", "--seq", "128")
    assert time.monotonic() - began < 60
    assert got["breakdown"]["total"] == gpuops.estimate(config=newest, seq_len=128).total_bytes


def test_a_name_with_control_characters_is_echoed_escaped():
    for name, shown in (("org/na\nme", "org/na\\x0ame"), ("\x00abc", "\\x00abc"), ("gpt\x1b[2J", "gpt\\x1b[2J")):
        with pytest.raises(ValueError) as error:
            gpuops.estimate(name)
        assert f"model '{shown}'" in str(error.value) and "\x00" not in str(error.value)
        result = run("estimate", "--model", name.replace("\x00", ""))
        assert result.returncode == 2 and "\x1b" not in result.stderr
    with pytest.raises(ValueError, match=r"gpu 'H\\x00100'"):
        gpuops.fit_table("gpt2", gpu="H\x00100")
