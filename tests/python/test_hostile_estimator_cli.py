"""Hostile input to gpuops.estimate and the `gpuops` command (issue 10, defects 1, 2 and 8): every case ends
in a TypeError/ValueError naming the argument, or exit status 2 (bad input) / 1 (output not written) with
one error line, never a traceback, a hang or a wrong number. The command runs both as the installed `gpuops`
(the native binary) and as `python -m gpuops.cli` (the Python API's front door)."""

import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gpuops

COMMANDS = [pytest.param([str(Path(sys.executable).parent / "gpuops")], id="native"),
            pytest.param([sys.executable, "-m", "gpuops.cli"], id="python-m")]


def run(command, *args, timeout=60, **kwargs):
    return subprocess.run([*command, *args], capture_output=True, timeout=timeout, **kwargs)


def assert_one_error_line(result, needle=b"", code=2):
    assert result.returncode == code, result
    assert b"Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(b"gpuops: error: "), result.stderr
    lines[0].decode("utf-8")  # printable UTF-8, whatever bytes the input had
    assert needle in result.stderr, result.stderr


# ---- defect 8: Python arguments of the wrong type or range name the argument -----------------------

@pytest.mark.parametrize("name, value, error", [
    ("micro_batch", 2.5, TypeError), ("micro_batch", "2", TypeError),
    ("micro_batch", math.nan, TypeError), ("micro_batch", 2**70, ValueError), ("micro_batch", True, TypeError),
    ("micro_batch", [2], TypeError), ("micro_batch", -(2**64), ValueError),
    ("seq_len", math.inf, TypeError), ("grad_accum", b"1", TypeError), ("num_gpus", 1.0, TypeError),
    ("zero_stage", 2**40, ValueError), ("zero_stage", "1", TypeError), ("lora_rank", 2**63, ValueError),
    ("precision", None, TypeError), ("precision", 16, TypeError), ("precision", b"fp32", TypeError),
    ("amp", None, TypeError), ("optimizer", ["adamw"], TypeError), ("optimizer_impl", 0, TypeError),
    ("checkpointing", None, TypeError), ("attention", 1, TypeError), ("base_dtype", None, TypeError),
    ("device", None, TypeError), ("lora_targets", 5, TypeError), ("lora_targets", [1, 2], TypeError),
    ("lora_targets", None, TypeError), ("lora_targets", b"q,v", TypeError),
])
def test_wrong_type_or_range_names_the_argument(name, value, error):
    with pytest.raises(error) as raised:
        gpuops.estimate("llama-2-7b", **{name: value})
    message = str(raised.value)
    assert name in message or name.replace("_", "-") in message, message
    assert "Invoked with" not in message and "incompatible function arguments" not in message, message


def test_numpy_integers_and_comma_targets_are_accepted():
    np = pytest.importorskip("numpy")
    reference = gpuops.estimate("gpt2", micro_batch=4, seq_len=128, lora_rank=8, lora_targets=("q", "v"))
    assert gpuops.estimate("gpt2", micro_batch=np.int64(4), seq_len=np.int32(128), lora_rank=8,
                           lora_targets="q,v") == reference


@pytest.mark.parametrize("kwargs, error, needle", [
    ({"model": 5}, TypeError, "model"),
    ({"model": ""}, ValueError, "model ''"),
    ({"model": "\udcff"}, ValueError, "model '\\xff'"),
    ({"params": True}, TypeError, "params"),
    ({"params": 0}, ValueError, "params"),
    ({"params": -5}, ValueError, "params"),
    ({"params": 2**70}, ValueError, "params"),
    ({"params": "0x10"}, ValueError, "params '0x10'"),
    ({"params": " 7B"}, ValueError, "params"),
    ({"params": math.nan}, ValueError, "params 'nan'"),
    ({"params": math.inf}, ValueError, "params 'inf'"),
    ({"params": 8e18}, ValueError, "params"),
    ({"params": [7]}, TypeError, "params"),
    ({"config": 5}, TypeError, "config"),
    ({"config": {"model_type": "gpt2", "n_embd": math.nan}}, ValueError, "config"),
    ({"config": {"model_type": "gpt2", "x": object()}}, TypeError, "config"),
    ({"config": {"model_type": "llama"}}, ValueError, "vocab_size"),
    ({"config": {"model_type": "llama", "vocab_size": 32000, "hidden_size": 10**9, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "intermediate_size": 11008}}, ValueError, "overflows 64 bits"),
    ({"config": {"model_type": "gpt2", "vocab_size": "50257", "n_embd": 768, "n_layer": 2, "n_head": 12,
                 "n_positions": 1024}}, ValueError, "vocab_size"),
])
def test_bad_model_arguments_name_the_argument(kwargs, error, needle):
    with pytest.raises(error, match=re.escape(needle)):
        gpuops.estimate(**kwargs)


# ---- defect 1: sizes past int64 are refused, and the limit given is exact ----------------------------

def accepted_max(message):
    return int(re.search(r"accepted: 1 to (\d+)", message).group(1))


@pytest.mark.parametrize("field, kwargs", [
    ("seq_len", {"model": "llama-2-7b", "attention": "eager", "seq_len": 3_000_000_000}),
    ("micro_batch", {"model": "llama-2-7b", "micro_batch": 4611686018427387904}),
    ("micro_batch", {"model": "gpt2", "micro_batch": 2**62, "seq_len": 1024, "device": "cpu"}),
])
def test_overflowing_sizes_are_refused_with_the_exact_limit(field, kwargs):
    with pytest.raises(ValueError, match="overflows 64 bits") as raised:
        gpuops.estimate(**kwargs)
    message = str(raised.value)
    assert ("seq" if field == "seq_len" else "batch") in message
    limit = accepted_max(message)
    ok = gpuops.estimate(**{**kwargs, field: limit})
    assert ok.total_bytes > 0 and min(ok.byte_items().values()) >= 0
    with pytest.raises(ValueError, match="overflows 64 bits"):
        gpuops.estimate(**{**kwargs, field: limit + 1})


def test_a_parameter_count_whose_bytes_overflow_is_refused():
    with pytest.raises(ValueError, match=r"params '8e18'.*accepted: 1 to \d+ parameters"):
        gpuops.estimate(params="8e18")
    with pytest.raises(ValueError, match="params"):
        gpuops.estimate(params=8 * 10**18)


def test_random_sizes_estimate_exactly_or_are_refused():
    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)
    for _ in range(100):
        batch, seq = (max(1, rng.getrandbits(62) >> rng.randrange(62)) for _ in range(2))
        try:
            b = gpuops.estimate("mistral-7b", micro_batch=batch, seq_len=seq,
                                attention=rng.choice(["eager", "sdpa", "flash"]))
        except ValueError as e:
            assert "overflows 64 bits" in str(e), (seed, batch, seq, e)
            continue
        assert min(b.byte_items().values()) >= 0, (seed, batch, seq, b)
        assert b.total_bytes < 2**63, (seed, batch, seq, b)


# ---- config files of the wrong kind ------------------------------------------------------------------

def test_config_files_of_the_wrong_kind(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        gpuops.estimate(config=tmp_path)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        gpuops.estimate(config=fifo)  # opening a FIFO with no writer would block forever
    with pytest.raises(ValueError, match="not a regular file"):
        gpuops.estimate(config="/dev/zero")
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"model_type": "gpt2\xff"}')
    with pytest.raises(ValueError, match="not valid JSON"):
        gpuops.estimate(config=bad)


def test_a_config_whose_name_is_not_utf8_loads(tmp_path):
    config = {"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 2, "n_head": 12,
              "n_positions": 1024}
    path = os.path.join(os.fsencode(tmp_path), b"cfg\xff.json")
    with open(path, "w") as f:
        json.dump(config, f)
    expected = gpuops.estimate(config=config, seq_len=64)
    assert gpuops.estimate(config=path, seq_len=64) == expected
    assert gpuops.estimate(config=os.fsdecode(path), seq_len=64) == expected  # str with a surrogate escape


# ---- defect 2: the command, as the native binary and from Python ------------------------------------

@pytest.mark.parametrize("command", COMMANDS)
def test_reported_cli_cases(command, tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"model_type": "gpt2\xff"}')
    cases = [
        (["estimate", "--model", "llama-2-7b", "--seq", "3000000000", "--attention", "eager"], b"seq"),
        (["estimate", "--params", "8e18"], b"params '8e18'"),
        (["estimate", "--model", "llama-2-7b", "--batch", "4611686018427387904"], b"batch"),
        (["estimate", "--model", "llama-2-7b", "--seq", "9223372036854775808"], b"--seq"),
        (["estimate", "--config", str(bad)], b"not valid JSON"),
        (["estimate", "--config", str(fifo)], b"not a regular file"),
        (["estimate", "--config", str(tmp_path)], b"is a directory"),
        (["estimate", "--model", "gpt2", "--gpu", ""], b"gpu ''"),
        (["estimate", "--params", "0x10"], b"params '0x10'"),
        ([b"estimate", b"--model", b"\xff\xfe"], b"model '\\xff\\xfe'"),
        ([b"\xc3"], b"command '\\xc3'"),
    ]
    for args, needle in cases:
        assert_one_error_line(run(command, *args, timeout=30), needle)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("args", [["estimate", "--model", "gpt2"], ["presets", "--json"], ["--help"]])
def test_output_to_a_full_device_exits_1_with_one_line(command, args):
    with open("/dev/full", "wb") as full:
        result = subprocess.run([*command, *args], stdout=full, stderr=subprocess.PIPE, timeout=60)
    assert_one_error_line(result, b"cannot write the output", code=1)
    with open("/dev/full", "wb") as full:  # nowhere to write even the error: the status says it
        result = subprocess.run([*command, *args], stdout=full, stderr=full, timeout=60)
    assert result.returncode == 1


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("args", [["gpus"], ["estimate", "--json"]])  # within and past one stdio buffer
def test_output_to_a_closed_pipe_exits_1_with_one_line(command, args):
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone (`gpuops ... | head` after head exits), with SIGPIPE at its default
    try:
        result = subprocess.run([*command, *args], stdout=write_end, stderr=subprocess.PIPE, timeout=60)
    finally:
        os.close(write_end)
    assert_one_error_line(result, b"cannot write the output", code=1)


@pytest.mark.parametrize("command", COMMANDS)
def test_non_utf8_config_path_and_output(command, tmp_path):
    path = os.path.join(os.fsencode(tmp_path), b"cfg\xff.json")
    with open(path, "w") as f:
        json.dump({"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 2, "n_head": 12,
                   "n_positions": 1024}, f)
    result = run(command, "estimate", "--config", path, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.decode("utf-8"))["runs"][0]["model"]["parameters"] > 0
    result = run(command, "estimate", "--config", path)
    assert result.returncode == 0 and b"cfg\\xff.json" in result.stdout, result


def test_python_main_takes_str_and_bytes(capfdbinary):
    from gpuops.cli import main

    assert main(["estimate", b"--model", "\udcff"]) == 2
    captured = capfdbinary.readouterr()
    assert captured.out == b"" and captured.err.startswith(b"gpuops: error: model '\\xff'")


# ---- issue 21: what a new user trips on --------------------------------------------------------------

@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("name", ["out.png", "out.PDF", "out", "svg"])
def test_a_plot_name_that_is_not_svg_is_refused(command, name, tmp_path):
    """--plot out.png wrote SVG bytes into a .png and exited 0."""
    assert_one_error_line(run(command, "estimate", "--model", "gpt2", "--plot", str(tmp_path / name)),
                          b"the picture is SVG; give a name ending in .svg")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="give a name ending in .svg"):
        gpuops.plot_estimate(tmp_path / name, "gpt2")
    assert run(command, "estimate", "--model", "gpt2", "--plot", str(tmp_path / "out.SVG")).returncode == 0


def test_advice_uses_the_advised_gpus_profile_throughout():
    """--advise RTX-4090 printed an H100's "context on sm_90" and two different totals "as given"."""
    result = run(COMMANDS[0].values[0], "estimate", "--model", "llama-2-7b", "--advise", "RTX-4090")
    assert result.returncode == 0, result.stderr
    text = result.stdout.decode()
    assert "context on sm_89" in text and "sm_90" not in text
    total = re.search(r"total\s+([\d.]+)\s+device used", text).group(1)
    assert f"as given, {total} GiB" in text  # the breakdown and the advice's "as given" are one estimate
    assert "headroom = memory minus the band's top" in text
