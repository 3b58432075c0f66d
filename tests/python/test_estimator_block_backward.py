"""A checkpointed block's backward begins with its MLP half while the whole block, just recomputed, is alive, with
the MLP's input gradients coming (docs/estimator.md, the attention-backward moment). On small models whose MLP is
wide (6-8 h) and whose vocabulary is small, that moment is the step's peak: their measured CPU peaks against the
estimate. (Before the moment was counted the estimates were 50-72% under.)"""

import os
import sys

import pytest

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench", "estimator_validation"))
from validate import Case, LoraCase, estimate_case, measure_case  # noqa: E402

MODELS = {"llama-wide-mlp": ("llama", dict(h=128, L=3, a=8, kv=8, i=1024, V=512, tied=False)),
          "llama-wide-mlp-gqa": ("llama", dict(h=96, L=2, a=6, kv=2, i=768, V=600, tied=False)),
          "gpt2-wide-mlp": ("gpt2", dict(h=128, L=2, a=4, i=1024, V=500, n_pos=512))}


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-mixed"])
def test_a_checkpointed_wide_mlp_is_estimated_within_5_percent_on_the_cpu(model, precision):
    case = Case(model, 8, 256, precision, "adamw", True, "sdpa")
    measured = measure_case(case, MODELS)["peak"]
    estimate = estimate_case(case, MODELS)
    assert estimate.peak_phase == "attention-backward"  # the last block's backward, not the loss's
    assert estimate.total_bytes == pytest.approx(measured, rel=0.05)


@pytest.mark.parametrize("precision", ["fp32"])  # bf16-mixed: 20% under, docs/estimator.md says why
def test_with_lora_adapters_and_their_dropout_within_8_percent(precision):
    case = LoraCase("llama-wide-mlp", precision, True, "sdpa", ("q", "k", "v", "o", "gate", "up", "down"), 8, 0.1,
                    batch=8, seq=256)
    measured = measure_case(case, MODELS)["peak"]
    estimate = estimate_case(case, MODELS)
    assert estimate.peak_phase == "attention-backward"
    assert estimate.total_bytes == pytest.approx(measured, rel=0.08)
