"""Activation-side setups against measured CPU peaks: op-level selective checkpointing (torch.utils.checkpoint,
non-reentrant, with torchtitan's "op" policy through create_selective_checkpoint_contexts) on Hugging Face Llama
models, two training steps under gpuops.memory_budget, compared with gpuops.estimate(checkpointing="selective",
device="cpu"). The forward-end bytes of these setups were checked to the byte while deriving the terms
(tests/cpp/test_estimator_setups_act.cpp); the whole-step peak is asserted within 10% here."""

import collections
import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "estimator_validation"))
import validate  # noqa: E402
from measure import make_config, measure_peak, model_factory_for, optimizer_factory_for  # noqa: E402

import gpuops  # noqa: E402

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts  # noqa: E402

# torchtitan's op save list (torchtitan/models/llama3/infra/parallelize.py) as far as these ops exist here.
SAVE_LIST = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten.max.default,
}


def torchtitan_op_policy():
    meta = collections.defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        key = "recompute_mm_count" if ctx.is_recompute else "forward_mm_count"
        if func == torch.ops.aten.mm.default:
            meta[key] += 1
        save = func in SAVE_LIST and not (func == torch.ops.aten.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def selective_factory(cfg, attention):
    base = model_factory_for("llama", cfg, attention)

    def factory():
        model = base()
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": torchtitan_op_policy})
        return model

    return factory


CASES = [  # (model name in validate.MODELS, batch, seq, precision, optimizer)
    ("llama-gqa-untied", 4, 128, "fp32", "adamw"),
    ("llama-gqa-untied", 4, 128, "bf16-mixed", "adamw"),
    ("llama-mqa-wide", 2, 64, "fp32", "sgd-momentum"),
    ("llama-tied", 4, 128, "bf16", "adamw"),
]


@pytest.mark.parametrize("name,batch,seq,precision,optimizer", CASES)
def test_selective_checkpointing_peak_within_10_percent(name, batch, seq, precision, optimizer):
    kind, cfg = validate.MODELS[name]
    assert kind == "llama"
    measured = measure_peak(selective_factory(cfg, "sdpa"), optimizer_factory_for(optimizer), batch, seq, precision,
                            checkpointing=False, meter="gpuops")["peak"]
    config = make_config(kind, cfg, "sdpa").to_dict()
    estimated = gpuops.estimate(config=config, precision=precision, optimizer=optimizer, checkpointing="selective",
                                attention="sdpa", micro_batch=batch, seq_len=seq, device="cpu").total_bytes
    assert abs(estimated - measured) <= 0.10 * measured, (name, measured, estimated)


def test_selective_sits_between_full_and_none():
    config = make_config("llama", validate.MODELS["llama-gqa-untied"][1], "sdpa").to_dict()
    totals = {c: gpuops.estimate(config=config, checkpointing=c, micro_batch=4, seq_len=1024).total_bytes
              for c in ("none", "selective", "full")}
    assert totals["full"] < totals["selective"] < totals["none"]


def test_keywords_are_checked():
    with pytest.raises(ValueError, match="loss"):
        gpuops.estimate("llama-2-7b", loss="chunked:0")
    with pytest.raises(ValueError, match="lora-dropout"):
        gpuops.estimate("llama-2-7b", lora_rank=8, lora_dropout=1.5)
    with pytest.raises(ValueError, match="lora-dropout"):
        gpuops.estimate("llama-2-7b", lora_rank=8, lora_dropout=float("nan"))
    with pytest.raises(TypeError, match="lora_dropout"):
        gpuops.estimate("llama-2-7b", lora_rank=8, lora_dropout="0.1")
    with pytest.raises(TypeError, match="compile"):
        gpuops.estimate("llama-2-7b", compile=1)
    with pytest.raises(ValueError, match="compile"):
        gpuops.estimate("llama-2-7b", compile=True, attention="eager")
    # A LoRA step peaks at the loss (a full fine-tune's foreach AdamW step would hide the difference).
    chunked = gpuops.estimate("llama-2-7b", loss="chunked:8", seq_len=2048, lora_rank=16)
    standard = gpuops.estimate("llama-2-7b", seq_len=2048, lora_rank=16)
    # the tensors (the allocator's rounding and reserve need not follow them)
    assert chunked.allocated_peak - chunked.block_rounding < standard.allocated_peak - standard.block_rounding


def test_bnb_version_is_the_engines():
    """gpuops.estimate(bnb_version=...) reaches the C++ engine: before 0.43.2 an nf4 base keeps each quantised
    linear's input, so the activations grow by the amount the C++ test derives by hand; bad values are refused."""
    kw = dict(lora_rank=16, base_dtype="nf4", precision="bf16", micro_batch=2, seq_len=512, lora_dropout=0.05)
    old = gpuops.estimate("llama-2-7b", bnb_version="0.42.0", **kw)
    new = gpuops.estimate("llama-2-7b", **kw)
    assert gpuops.estimate("llama-2-7b", bnb_version="0.43.2", **kw).activations == new.activations
    # Per block: attention-norm output and MLP-norm output (N x 4096 each) and down's input (N x 11008), bf16;
    # the first block keeps no attention input. N = 1024 tokens, 32 blocks.
    n = 2 * 512
    block = n * 2 * (4096 + 4096 + 11008)
    assert old.activations - new.activations == 32 * block - n * 2 * 4096
    with pytest.raises(ValueError, match="bnb-version"):
        gpuops.estimate("llama-2-7b", bnb_version="0.43.x", **kw)
    with pytest.raises(TypeError, match="bnb_version"):
        gpuops.estimate("llama-2-7b", bnb_version=0.42, **kw)


def test_zero_bucket_bytes_is_the_engines():
    """zero_bucket_bytes (gpuops.ZeroOptimizer reducing in the backward) reaches the C++ engine: the buckets in
    flight are counted on top of DeepSpeed's 1/N gradients; bad values are refused naming the argument."""
    kw = dict(zero_stage=2, num_gpus=4, micro_batch=1, seq_len=128, precision="fp32", optimizer_impl="fused")
    deepspeed = gpuops.estimate("gpt2", **kw)
    ours = gpuops.estimate("gpt2", zero_bucket_bytes=4 << 20, **kw)
    assert ours.total_bytes > deepspeed.total_bytes
    with pytest.raises(TypeError, match="zero_bucket_bytes"):
        gpuops.estimate("gpt2", zero_bucket_bytes=4.0, **kw)
    with pytest.raises(ValueError, match="zero-bucket-bytes"):
        gpuops.estimate("gpt2", zero_bucket_bytes=-1, **kw)
    with pytest.raises(ValueError, match="zero-bucket-bytes"):
        gpuops.estimate("gpt2", zero_bucket_bytes=4 << 20, zero_stage=3, num_gpus=4)


def test_held_logits_match_the_measured_peak():
    """held_logits="model" against a loop that keeps `out` (measure.py's hold_outputs: out.logits alive through
    backward and step until the next forward replaces it): the same peak to 0.01%, whether the peak is in the
    backward (llama-gqa-untied) or at the optimizer step (gpt2-untied-inner), and one N x V x 4 above the loop
    that keeps only the loss."""
    from measure import measure_peak, optimizer_factory_for

    for name, attention, phase in (("llama-gqa-untied", "sdpa", "backward"), ("gpt2-untied-inner", "eager", "optimizer")):
        kind, cfg = validate.MODELS[name]
        config = make_config(kind, cfg, attention).to_dict()
        measured = {hold: measure_peak(model_factory_for(kind, cfg, attention), optimizer_factory_for("adamw"), 2, 64,
                                       "fp32", meter="gpuops", hold_outputs=hold) for hold in (False, True)}
        est = {held: gpuops.estimate(config=config, precision="fp32", attention=attention, micro_batch=2, seq_len=64,
                                     device="cpu", held_logits=held) for held in ("none", "model")}
        assert measured[True]["peak_phase"].startswith(phase), measured[True]["peak_phase"]
        assert abs(est["model"].total_bytes - measured[True]["peak"]) <= 1e-4 * measured[True]["peak"], name
        assert est["model"].total_bytes - est["none"].total_bytes == 2 * 64 * cfg["V"] * 4
