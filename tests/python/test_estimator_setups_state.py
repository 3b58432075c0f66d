"""Adafactor in the estimator against transformers' own Adafactor on the CPU (docs/estimator.md, "Optimizers,
offload and sharding"): the optimizer's state bytes exactly (summed over optimizer.state), and the measured
peak of two training steps under gpuops.memory_budget within the validation grid's 10%."""

import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "estimator_validation"))
import gpuops  # noqa: E402
from measure import make_config, measure_peak, model_factory_for  # noqa: E402

# Untied Llamas (GQA and MQA): the embedding and the LM head are the largest matrices, norms are 1-D.
MODELS = {
    "llama-gqa-untied": ("llama", dict(h=128, L=3, a=8, kv=2, i=344, V=4000, tied=False)),
    "llama-mqa-wide": ("llama", dict(h=256, L=2, a=4, kv=1, i=704, V=7000, tied=False)),
}
PRECISIONS = ["fp32", "bf16-mixed", "bf16"]
BATCH, SEQ = 2, 64


def _measure(model, precision):
    from transformers.optimization import Adafactor

    kind, cfg = MODELS[model]
    holder = {}

    def factory(params):  # transformers' defaults but an external learning rate (relative_step needs lr=None)
        holder["opt"] = Adafactor(params, lr=1e-3, relative_step=False, scale_parameter=False, warmup_init=False)
        return holder["opt"]

    result = measure_peak(model_factory_for(kind, cfg, "sdpa"), factory, BATCH, SEQ, precision, False, meter="gpuops")
    state_bytes = sum(v.numel() * v.element_size() for st in holder["opt"].state.values() for v in st.values()
                      if torch.is_tensor(v))
    return result["peak"], state_bytes


def _estimate(model, precision):
    kind, cfg = MODELS[model]
    config = make_config(kind, cfg, "sdpa").to_dict()
    return gpuops.estimate(config=config, precision=precision, optimizer="adafactor", attention="sdpa",
                           micro_batch=BATCH, seq_len=SEQ, device="cpu")


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("precision", PRECISIONS)
def test_adafactor_states_exact_and_peak_within_10_percent(model, precision):
    measured_peak, measured_states = _measure(model, precision)
    est = _estimate(model, precision)
    # Factored fp32 row/column vectors, full 1-D second moments and one 0-d 'RMS' per tensor: to the byte.
    assert est.optimizer_states == measured_states
    error = (est.total_bytes - measured_peak) / measured_peak
    assert abs(error) <= 0.10, f"{model} {precision}: measured {measured_peak}, estimated {est.total_bytes}"


def test_adafactor_state_is_far_below_adamw():
    # Reference from the shapes: the estimate's states for Adafactor are below 1% of AdamW's 8 bytes/param.
    kind, cfg = MODELS["llama-mqa-wide"]
    config = make_config(kind, cfg, "sdpa").to_dict()
    ada = gpuops.estimate(config=config, precision="fp32", optimizer="adafactor", device="cpu")
    adamw = gpuops.estimate(config=config, precision="fp32", optimizer="adamw", device="cpu")
    assert ada.optimizer_states * 100 < adamw.optimizer_states


def test_new_keywords_are_type_checked_and_named():
    with pytest.raises(TypeError, match="offload_optimizer"):
        gpuops.estimate("llama-2-7b", offload_optimizer=1)
    with pytest.raises(TypeError, match="reshard_after_forward"):
        gpuops.estimate("llama-2-7b", sharding="fsdp2", num_gpus=8, reshard_after_forward="false")
    with pytest.raises(ValueError, match="sharding 'fsdp3' is not accepted"):
        gpuops.estimate("llama-2-7b", sharding="fsdp3")
    with pytest.raises(ValueError, match="offload-optimizer with optimizer sgd"):
        gpuops.estimate("llama-2-7b", optimizer="sgd", offload_optimizer=True)
    with pytest.raises(ValueError, match="has no LM head"):
        gpuops.estimate("bert-base", lora_rank=8, lora_targets=("q", "lm_head"))
    keep = gpuops.estimate("llama-2-7b", sharding="fsdp2", num_gpus=8, reshard_after_forward=False)
    reshard = gpuops.estimate("llama-2-7b", sharding="fsdp2", num_gpus=8)
    assert keep.total_bytes > reshard.total_bytes  # every block stays unsharded from forward to backward


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_gpuops_8bit_adamw_states_to_the_byte(model, precision):
    """gpuops.optim.AdamW(state_bits=8)'s own state tensors after a step (codes, scales, fp32 moments of the
    tensors under 4096 values, step counters) against the estimate's optimizer_states, byte for byte."""
    kind, cfg = MODELS[model]
    module = model_factory_for(kind, cfg, "sdpa")()
    opt = gpuops.optim.AdamW(module.parameters(), lr=1e-3, state_bits=8)
    for p in module.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    measured = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                   if torch.is_tensor(v))
    assert any("exp_avg_codes" in st for st in opt.state.values()) and any("exp_avg" in st for st in opt.state.values())
    config = make_config(kind, cfg, "sdpa").to_dict()
    est = gpuops.estimate(config=config, precision=precision, optimizer="gpuops-adamw-8bit", attention="sdpa",
                          micro_batch=BATCH, seq_len=SEQ, device="cpu")
    assert est.optimizer_states == measured
    adamw = gpuops.estimate(config=config, precision=precision, optimizer="adamw", attention="sdpa",
                            micro_batch=BATCH, seq_len=SEQ, device="cpu")
    assert est.optimizer_states * 3 < adamw.optimizer_states  # about a quarter


def test_gpuops_8bit_adamw_is_refused_where_it_is_not_modelled():
    with pytest.raises(ValueError, match="gpuops-adamw-8bit needs an architecture"):
        gpuops.estimate(params="7b", optimizer="gpuops-adamw-8bit")
    with pytest.raises(ValueError, match="stage 3's per-unit buffers are not modelled yet"):
        gpuops.estimate("llama-2-7b", optimizer="gpuops-adamw-8bit", zero_stage=3, num_gpus=4, sharding="gpuops")


def test_gpuops_offload_and_8bit_states_under_its_zero_optimizer():
    """With gpuops' ZeroOptimizer (zero_reduce): --advise offers its own offload and its 8-bit states (stages 1-2),
    and offload moves the moments, the fp32 shard copies and the gradient shards to the host (measured against
    ZeroOptimizer(offload="cpu") in test_zero_estimate.py)."""
    setup = dict(zero_stage=2, num_gpus=4, zero_reduce="step", precision="bf16-mixed", amp="master-copy")
    advice = gpuops.advise("RTX-4090", "llama-2-7b", **setup)
    described = {a.options: a.description for a in advice}
    assert "ZeroOptimizer(offload=\"cpu\")" in described["--offload-optimizer"], described
    assert "--optimizer gpuops-adamw-8bit" in described
    plain = gpuops.estimate("llama-2-7b", **setup)
    offloaded = gpuops.estimate("llama-2-7b", **setup, offload_optimizer=True)
    eight = gpuops.estimate("llama-2-7b", **setup, offload_optimizer=True, optimizer="gpuops-adamw-8bit")
    local = -(-6738415616 // 4)  # llama-2-7b's parameters, one rank's shard
    assert offloaded.optimizer_states == 0 and offloaded.master_weights == 0
    assert offloaded.host_memory == plain.optimizer_states + 4 * local + 4 * local  # moments, fp32 copies, gradients
    assert plain.total_bytes - offloaded.total_bytes >= plain.optimizer_states + plain.master_weights
    assert eight.host_memory < offloaded.host_memory
    # Stage 3 (--sharding gpuops): its own offload offered and modelled; the gradient shards leave the device too,
    # the shard its units gather stays.
    setup = dict(zero_stage=3, num_gpus=4, sharding="gpuops", precision="bf16-mixed", amp="master-copy")
    described = {a.options: a.description for a in gpuops.advise("RTX-4090", "llama-2-7b", **setup)}
    assert "ZeroOptimizer(offload=\"cpu\")" in described["--offload-optimizer"], described
    plain = gpuops.estimate("llama-2-7b", **setup)
    offloaded = gpuops.estimate("llama-2-7b", **setup, offload_optimizer=True)
    assert offloaded.optimizer_states == 0 and offloaded.master_weights == 0 and offloaded.gradients == 0
    assert plain.master_weights == 4 * local and plain.gradients == 4 * local
    assert offloaded.host_memory == plain.optimizer_states + 4 * local + 4 * local  # moments, fp32 shard, gradients
    assert offloaded.weights == plain.weights
