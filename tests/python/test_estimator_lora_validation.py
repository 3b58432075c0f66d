"""LoRA (PEFT) activations are exact bookkeeping: gpuops.estimate(..., device="cpu") against the counting
allocator's measured peak of real PEFT training steps on held-out Llama configs (every case within 3%, the
median within 1%; the terms are derived in bench/estimator_validation/FINDINGS.md, "LoRA (PEFT)")."""

import os
import statistics
import sys

import pytest

pytest.importorskip("peft")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "estimator_validation"))
import validate  # noqa: E402


@pytest.fixture(scope="module")
def rows():
    return validate.run_lora(validate.lora_grid())


def test_lora_grid_covers_precisions_checkpointing_attention_ranks_dropout_and_targets():
    cases = validate.lora_grid()
    assert {c.precision for c in cases} == set(validate.PRECISIONS)
    assert {c.checkpointing for c in cases} == {False, True}
    assert {c.attention for c in cases} == set(validate.ATTENTION)
    assert {c.rank for c in cases} == set(validate.LORA_RANKS)
    assert {c.dropout for c in cases} == set(validate.LORA_DROPOUTS)
    assert {len(c.targets) for c in cases} == {2, 7}


def test_every_lora_case_within_3_percent(rows):
    bad = [f"{r['case'].label()}: {100 * r['error']:+.3f}%" for r in rows if abs(r["error"]) > 0.03]
    assert not bad, "\n".join(bad)


def test_lora_median_error_within_1_percent(rows):
    assert statistics.median(abs(r["error"]) for r in rows) <= 0.01


def test_lora_adapters_are_fp32_under_a_bf16_base():
    # What PEFT does (autocast_adapter_dtype=True): get_peft_model on a bf16 model makes the adapters fp32.
    import torch
    from measure import lora_model_factory_for

    kind, cfg = validate.LORA_MODELS["llama-tied"]
    model = lora_model_factory_for(kind, cfg, "sdpa", 8, ("q", "v"), base="bf16")()
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for n, p in model.named_parameters() if p.requires_grad} == {torch.float32}
