"""gpuops.estimate_svg / plot_estimate / advise: the C++ engine of `gpuops estimate --plot` and `--advise`."""

import inspect
import json
import os
import stat
import xml.etree.ElementTree as ET

import pytest

import gpuops

SVG = "{http://www.w3.org/2000/svg}"
GIB = 1 << 30
LLAMA_7B_PARAMS = 6_738_415_616  # Hugging Face LlamaForCausalLM, llama-2-7b
FULL = dict(precision="bf16-mixed", optimizer="adamw", seq_len=2048, micro_batch=1)


def test_svg_parses_as_xml_with_a_bar_per_phase_and_per_gpu():
    text = gpuops.estimate_svg("llama-2-7b", gpu="RTX-4090", **FULL)
    root = ET.fromstring(text.encode())  # a real XML parser: well-formed
    assert root.tag == SVG + "svg"
    phases = [g.get("data-phase") for g in root.iter(SVG + "g") if g.get("data-phase")]
    assert phases == ["loss-backward", "attention-backward", "backward-end", "optimizer-step"]
    bars = [r.get("data-gpu") for r in root.iter(SVG + "rect") if r.get("class") == "gpu-bar"]
    assert bars == [g["name"] for g in gpuops.gpu_catalog()]
    peak = [g for g in root.iter(SVG + "g") if g.get("class") == "phase peak"]
    estimate = gpuops.estimate("llama-2-7b", **FULL, device="cuda")
    assert len(peak) == 1
    # the peak of the picture is the estimate's (on the same CUDA profile: the RTX 4090's, as --gpu does)
    assert peak[0].get("data-phase") in {"loss-backward", "attention-backward", "backward-end", "optimizer-step"}
    assert any(g.get("class") == "memory-line" for g in root.iter(SVG + "g"))
    assert estimate.total_bytes > 0
    legend = [t.text for g in root.iter(SVG + "g") if g.get("class") == "legend" for t in g.iter(SVG + "text")]
    assert "weights" in legend and "optimizer_states" in legend


def test_svg_is_the_command_lines_picture(tmp_path):
    path = tmp_path / "cli.svg"
    code, out, err = gpuops._C.run_cli(["estimate", "--model", "gpt2", "--seq", "256", "--plot", os.fsencode(path)])
    assert code == 0, err
    assert err == os.fsencode(f"gpuops: wrote the picture of 1 run to {path}\n")  # on stderr: stdout is the report
    from_python = gpuops.estimate_svg("gpt2", seq_len=256)
    # Same engine: the command line's panel title is its run label, the same words for one setup.
    assert path.read_text(encoding="utf-8") == from_python


def test_version():
    code, out, err = gpuops._C.run_cli(["--version"])
    assert (code, out, err) == (0, f"gpuops {gpuops.__version__}\n".encode(), b"")


def test_names_are_escaped(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
              "max_position_embeddings": 256}
    folder = tmp_path / "a<b&\"c'd"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    text = gpuops.estimate_svg(config=str(folder / "config.json"), seq_len=64, device="cpu")
    root = ET.fromstring(text.encode())  # parses: the name is escaped
    titles = [t.text for t in root.iter(SVG + "text") if t.get("class") == "title"]
    assert titles == [f"full fine-tune of {folder / 'config.json'}"]  # and reads back as given
    assert "a&lt;b&amp;&quot;c&apos;d" in text


def test_plot_estimate_writes_atomically_and_reports_os_errors(tmp_path):
    target = tmp_path / "p.svg"
    assert gpuops.plot_estimate(target, "gpt2", seq_len=128) == str(target)
    ET.parse(target)
    assert sorted(os.listdir(tmp_path)) == ["p.svg"]  # no temporary left behind
    mode = stat.S_IMODE(os.stat(target).st_mode)
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask
    with pytest.raises(OSError):
        gpuops.plot_estimate(tmp_path / "missing" / "p.svg", "gpt2", seq_len=128)
    (tmp_path / "d.svg").mkdir()
    with pytest.raises(OSError):
        gpuops.plot_estimate(tmp_path / "d.svg", "gpt2", seq_len=128)  # a directory
    with pytest.raises(TypeError):
        gpuops.plot_estimate(3, "gpt2")
    assert sorted(os.listdir(tmp_path)) == ["d.svg", "p.svg"]


def test_keywords_are_estimates(tmp_path):
    with pytest.raises(TypeError, match=r"estimate_svg\(\) got an unexpected keyword argument 'batch_size'"):
        gpuops.estimate_svg("gpt2", batch_size=2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'batch_size'"):
        gpuops.plot_estimate(tmp_path / "p.svg", "gpt2", batch_size=2)
    with pytest.raises(TypeError, match=r"advise\(\) got an unexpected keyword argument 'batch_size'"):
        gpuops.advise("H100-80GB", "gpt2", batch_size=2)
    # the command line's spellings are estimate()'s too
    assert gpuops.estimate_svg("gpt2", batch=2, seq=256) == gpuops.estimate_svg("gpt2", micro_batch=2, seq_len=256)
    assert not os.listdir(tmp_path)
    # every estimate() keyword is accepted (with its default value)
    keywords = {n: p.default for n, p in inspect.signature(gpuops.estimate).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY and n not in {"config", "params", "gpu"}}
    gpuops.estimate_svg("gpt2", **keywords)
    keywords.pop("device")
    gpuops.advise("H100-80GB", "gpt2", **keywords)
    with pytest.raises(ValueError, match="micro-batch"):
        gpuops.estimate_svg("gpt2", micro_batch=0)
    with pytest.raises(TypeError, match="micro_batch"):
        gpuops.advise("H100-80GB", "gpt2", micro_batch=1.5)


def test_advise_full_finetune_on_a_24_gib_gpu():
    advice = gpuops.advise("RTX-3090", "llama-2-7b", **FULL)
    # Weights, gradients and AdamW states in fp32: 16 bytes a parameter, far more than 24 GiB.
    assert 16 * LLAMA_7B_PARAMS > 24 * GIB
    assert advice.gpu == "RTX-3090" and advice.memory_bytes == 24 * GIB
    assert not advice.fits and advice.headroom_bytes < 0
    assert advice and advice[0].fits
    fits = [a.fits for a in advice]
    assert fits == sorted(fits, reverse=True)  # fitting ones first
    for a in advice:  # (the C++ tests recompute each figure on the RTX 3090's own profile)
        assert a.total_bytes == a.breakdown.total_bytes
        assert a.headroom_bytes == 24 * GIB - a.total_high_bytes < 24 * GIB - a.total_bytes
        assert a.setup["seq_len"] == 2048 and a.setup["precision"] == "bf16-mixed"
        assert a.options.startswith("--")
    lora = [a for a in advice if a.setup["lora_rank"]]
    assert {a.setup["base_dtype"] for a in lora} == {"bf16", "nf4"}
    assert all(a.setup["lora_rank"] == 16 and list(a.setup["lora_targets"]) == ["q", "k", "v", "o"] for a in lora)
    assert all(not a.keeps_numerics for a in lora)


def test_advise_matches_the_command_line():
    code, out, err = gpuops._C.run_cli(["estimate", "--model", "llama-2-7b", "--seq", "2048", "--advise", "RTX-3090",
                                        "--json"])
    assert code == 0, err
    run = json.loads(out)["runs"][0]
    advice = gpuops.advise("RTX-3090", "llama-2-7b", **FULL)
    assert [a["options"] for a in run["advice"]] == [a.options for a in advice]
    assert [a["total_bytes"] for a in run["advice"]] == [a.total_bytes for a in advice]
    assert run["advice_for"]["fits"] == advice.fits
    assert run["advice_for"]["total_bytes"] == advice.total_bytes


@pytest.mark.parametrize("args", [
    ["--model", "llama-3-8b", "--lora-rank", "16", "--base-dtype", "nf4", "--batch", "4", "--seq", "4096",
     "--checkpointing", "full", "--advise", "RTX-4090"],  # logits most of the peak: the loss options lead
    ["--model", "llama-3.2-1b", "--batch", "4", "--held-logits", "fp32", "--zero-grad", "zeros", "--gpus", "2",
     "--zero", "1", "--zero-reduce", "step", "--advise", "L4"],
    ["--model", "llama-2-7b", "--lora-rank", "8", "--lora-dropout", "0.1", "--advise", "T4"],
])
def test_each_advice_is_what_its_options_give_on_the_command_line(args):
    """What a user does with the advice: copy its options onto the command. The estimate that gives is the
    advice's; the Python setup replays it too; and the ranking: those that fit by cost, then changes, then memory
    saved; then those that do not, the smallest shortfall (the most saved) first."""
    code, out, err = gpuops._C.run_cli(["estimate", *args, "--json"])
    assert code == 0, err
    run = json.loads(out)["runs"][0]
    advice = run["advice"]
    assert advice
    costs = ["none", "recompute", "slower", "communication", "numerics"]
    ranked = [(not a["fits"], costs.index(a["cost"]) if a["fits"] else 0, a["changes"] if a["fits"] else 0,
               -a["saved_bytes"]) for a in advice]
    assert ranked == sorted(ranked)
    for a in advice:
        code, out, err = gpuops._C.run_cli(["estimate", *_with_options(args, a["options"].split()), "--json"])
        assert code == 0, (a["options"], err)
        assert json.loads(out)["runs"][0]["advice_for"]["total_bytes"] == a["total_bytes"], a["options"]
        assert a["saved_bytes"] == run["advice_for"]["total_bytes"] - a["total_bytes"] > 0
    model = args[1]
    ours = gpuops.advise(args[-1], model, **_keywords(args[2:-2]))
    assert [a.options for a in ours] == [a["options"] for a in advice]
    for a in ours:
        assert gpuops.estimate(model, device="cuda", gpu=args[-1], **a.setup).total_bytes == a.total_bytes


def _options(cli):
    """{option: value, or None for a flag} of a command line's options, in order."""
    out = {}
    for i, token in enumerate(cli):
        if token.startswith("--"):
            value = cli[i + 1] if i + 1 < len(cli) and not cli[i + 1].startswith("--") else None
            out[token] = value
    return out


def _with_options(cli, changes):
    """The command line with the advice's options in place of the same ones (an option is given once)."""
    merged = {**_options(cli), **_options(changes)}
    return [t for option, value in merged.items() for t in ([option] if value is None else [option, value])]


def _keywords(cli):
    """The command line's options as estimate()'s keywords."""
    pairs = dict(zip(cli[::2], cli[1::2]))
    out = {}
    for option, value in pairs.items():
        name = option[2:].replace("-", "_")
        out[name] = int(value) if value.isdigit() else float(value) if name == "lora_dropout" else value
    return out


def test_a_setup_that_fits_says_so():
    advice = gpuops.advise("H200", "gpt2", seq_len=256)
    assert advice.fits and advice.headroom_bytes > 0
    assert advice.total_high_bytes + advice.headroom_bytes == advice.memory_bytes


def test_bad_gpu_names_the_keyword():
    with pytest.raises(ValueError, match="gpu: gpu 'Z9000' is not in the catalog"):
        gpuops.advise("Z9000", "gpt2")
    with pytest.raises(ValueError, match="gpu"):
        gpuops.estimate_svg("gpt2", gpu="Z9000")
    with pytest.raises(TypeError, match="gpu"):
        gpuops.advise(None, "gpt2")
    with pytest.raises(ValueError, match="device 'tpu' is not accepted; accepted: 'cuda', 'cpu'"):
        gpuops.advise("H200", "gpt2", device="tpu")
    # device="cpu" advises for the GPU anyway, as the command line's --advise --device cpu does
    assert gpuops.advise("H200", "gpt2", device="cpu").total_bytes == gpuops.advise("H200", "gpt2").total_bytes
