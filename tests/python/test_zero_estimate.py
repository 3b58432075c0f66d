"""`gpuops estimate --zero 1|2 --gpus 2 --zero-reduce step` (and `--zero-reduce backward --zero-bucket-bytes B` for
reduce_in_backward) against the per-rank peaks of gpuops.ZeroOptimizer:
validate.py's held-out Hugging Face models trained by 2 CPU processes over Gloo, each rank's peak measured by
gpuops.memory_budget (bench/estimator_validation/zero_ranks.py; the rows are in docs/estimator.md)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "estimator_validation"))
import zero_ranks  # noqa: E402


def test_per_rank_estimate_matches_measured_zero_peaks():
    everything = zero_ranks.run(2)
    rows = [r for r in everything if r["stage"] < 3 and not r["offload"]]
    _stage3(r for r in everything if r["stage"] == 3 and not r["offload"])
    _offloaded((r for r in everything if r.get("offload")), everything)
    assert {(r["stage"], r["model"]) for r in rows} == {(s, c[0]) for s in (1, 2) for c in zero_ranks.CASES}
    assert any(r["reduce_in_backward"] and r["bucket_bytes"] < 2**20 for r in rows)  # several buckets
    assert {r["dtype"] for r in rows} == {"fp32", "bf16"}  # bf16 parameters: fp32 masters, fp32 reduction chunks
    errors = sorted((r["estimated"] - m) / m for r in rows for m in r["measured"])
    labels = "\n".join(f"{r['model']} stage {r['stage']} reduce_in_backward {r['reduce_in_backward']} bucket "
                       f"{r['bucket_bytes']}: estimated {r['estimated']}, measured per rank {r['measured']}" for r in rows)
    # Measured 2026-11-24: 46 of 54 rank peaks within 200 bytes (the optimizers' step counters); over by 3.3%
    # and 3.6% (llama-gqa-untied's 256 KiB buckets, bf16 and fp32: the bound of three buckets in flight) and
    # 6.2% (its fp32 stage-1 step when Gloo's worker does not hold the reduce clones into the all-gathers, which
    # it does now and then); under by 0.2% (gpt2-tied's one fp32 bucket, 58 kB in a mid-backward moment).
    assert abs(errors[len(errors) // 2]) <= 1e-3, labels
    assert errors[0] >= -0.005, labels  # never under by more than 0.5%
    assert errors[-1] <= 0.065, labels
    for r in rows:  # the optimizer state is the estimator's to the step counters (per bucket here, per tensor there)
        assert abs(r["state_bytes"] - r["est_optimizer_states"]) <= 4 * 64, labels


def _offloaded(rows, everything):
    """ZeroOptimizer(offload="cpu") against `--offload-optimizer` with `--zero-reduce` (stages 1-2) or `--sharding
    gpuops` (stage 3): the device side (the host's allocations are outside the budget), and the host's state
    against the estimate's host memory."""
    rows = list(rows)
    assert {(r["dtype"], r["stage"], r["reduce_in_backward"]) for r in rows} == {
        ("fp32", 2, False), ("bf16", 1, False), ("bf16", 2, False), ("fp32", 2, True), ("fp32", 3, True),
        ("bf16", 3, True)}
    for r in rows:  # the host holds the moments, the fp32 shard copies and the gradient shards
        assert r["state_bytes"] <= r["est_host"], r
    _stage3_offload_saves_what_is_estimated([r for r in rows if r["stage"] == 3], everything)
    rows = [r for r in rows if r["stage"] < 3]
    errors = sorted((r["estimated"] - m) / m for r in rows for m in r["measured"])
    labels = "\n".join(f"{r['model']} {r['dtype']} stage {r['stage']} offloaded, reduce_in_backward "
                       f"{r['reduce_in_backward']}: estimated {r['estimated']}, measured per rank {r['measured']}"
                       for r in rows)
    print(labels)
    # Measured 2026-11-29 (2 ranks): 22 of 24 rank peaks within 100 bytes; llama-gqa-untied reducing in the
    # backward over by 5.5% (the same bytes as without offload, the bound of three buckets in flight, on a smaller
    # total).
    assert abs(errors[len(errors) // 2]) <= 1e-3, labels
    assert errors[0] >= -0.005, labels
    assert errors[-1] <= 0.065, labels


def _stage3_offload_saves_what_is_estimated(rows, everything):
    """Stage 3's own error (a Gloo copy of a whole block held or not at the peak, by timing) is _stage3's; what
    offload changes on the device is checked here: the peak's drop against the estimate's, per rank. The ranks'
    peaks differ by whole fp32 blocks on some runs, so the drop is held to one fp32 block of the model.
    Measured 2026-11-29 (2 ranks): gpt2-untied-inner and llama bf16 within 100 bytes of the estimate's drop;
    gpt2-tied fp32 108 776 bytes off (of 8.03 MB); llama fp32 one rank 0.40 MB, the other 0.69 MB (one block)."""
    for r in rows:
        base = next(b for b in everything if b["stage"] == 3 and not b["offload"] and b["model"] == r["model"]
                    and b["dtype"] == r["dtype"] and b["reshard_after_forward"] == r["reshard_after_forward"])
        estimated = base["estimated"] - r["estimated"]
        for measured_base, measured in zip(base["measured"], r["measured"]):
            assert abs((measured_base - measured) - estimated) <= r["block_fp32_bytes"], (r, base)


def _stage3(rows):
    """`--sharding gpuops` (ZeroOptimizer stage 3: units gathered, fp32 gradient shards, reductions in flight)."""
    rows = list(rows)
    assert {(r["model"], r["dtype"], r["reshard_after_forward"]) for r in rows} == {
        (c[0], d, f) for c in zero_ranks.CASES for d in ("fp32", "bf16") for f in (True, False)}
    errors = sorted((r["estimated"] - m) / m for r in rows for m in r["measured"])
    labels = "\n".join(f"{r['model']} {r['dtype']} stage 3 reshard_after_forward {r['reshard_after_forward']}: "
                       f"estimated {r['estimated']} ({r['est_phase']}), measured per rank {r['measured']}" for r in rows)
    print(labels)
    # Measured 2026-11-27 (2 ranks): 22 of 24 rank peaks within 100 bytes; gpt2-tied fp32 with
    # reshard_after_forward under by 3.7% and 6.0% (its peak is in a middle block's backward, where Gloo's copies
    # of the prefetched block's gather add what the model leaves out), llama fp32 rank 0 by 1.3% on some runs.
    assert abs(errors[len(errors) // 2]) <= 0.01, labels
    assert errors[0] >= -0.08, labels
    assert errors[-1] <= 0.05, labels
    for r in rows:  # moments and fp32 masters (16-bit) or the parameters' shard (fp32): 1/N, to the step counters
        assert abs(r["state_bytes"] - r["est_optimizer_states"]) <= 4 * 64, labels
