"""`gpuops estimate --zero 1|2 --gpus 2 --zero-reduce step` against the per-rank peaks of gpuops.ZeroOptimizer:
validate.py's held-out Hugging Face models trained by 2 CPU processes over Gloo, each rank's peak measured by
gpuops.memory_budget (bench/estimator_validation/zero_ranks.py; the rows are in docs/estimator.md)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "estimator_validation"))
import zero_ranks  # noqa: E402


def test_per_rank_estimate_matches_measured_zero_peaks():
    rows = zero_ranks.run(2)
    assert {(r["stage"], r["model"]) for r in rows} == {(s, c[0]) for s in (1, 2) for c in zero_ranks.CASES}
    # reduce_in_backward rows are printed, not checked: the estimator's "backward" (DeepSpeed's) does not count
    # the buckets in flight (docs/estimator.md).
    checked = [r for r in rows if not r["reduce_in_backward"]]
    errors = sorted(abs(r["estimated"] - m) / m for r in checked for m in r["measured"])
    labels = "\n".join(f"{r['model']} stage {r['stage']}: estimated {r['estimated']}, measured per rank {r['measured']}"
                       for r in checked)
    # Every rank's peak to 0.1% (measured: 100 bytes of 30-77 MB, the optimizers' step counters), but for a
    # transient that now and then adds 1.8 MB (5.9%) to llama-gqa-untied's stage-1 peak on one or both ranks,
    # not explained yet (docs/estimator.md): the median to 0.1%, every one to 6.5%.
    assert errors[len(errors) // 2] <= 1e-3, labels
    assert errors[-1] <= 0.065, labels
    for r in checked:  # the optimizer state is the estimator's to the step counters (per bucket here, per tensor there)
        assert abs(r["state_bytes"] - r["est_optimizer_states"]) <= 4 * 64, labels
