"""The estimator against published GPU memory measurements (issue 12, item 3): the rows of
bench/estimator_validation/published/measurements.json, mapped to gpuops.estimate by the tables of validate_published.py
beside it (the comparison logic lives there; this file asserts on its results)."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "estimator_validation", "published"))
import validate_published as validate  # noqa: E402

# The targets on the stated and assumed rows are median |error| <= 5%, max |error| <= 10% and never under by more
# than 3% on device memory used, on rows held out from fitting (issue 23). Where the estimator does not meet them
# yet, the bounds below are the current figures rounded up by at most one percentage point (a regression bound,
# not the target); docs/estimator.md, "Validation against published GPU measurements", says why.
# Fitting rows (measurements.json, looked at while the terms were built; 2026-11-27, after torchtune's 1e9-byte
# "GB" and reserved stat were corrected and LitGPT's fused q|k|v became a term): 42 rows, median 7.4%, max 21.8%
# (litgpt-gemma-2b-qlora-a10g), worst device-used -14.6% (hf-perfone-bertlarge-fp16-b4); every one inside the
# band (the band is set so).
MEDIAN_ABS_ERROR_BOUND = 0.08
MAX_ABS_ERROR_BOUND = 0.225
DEVICE_USED_UNDER_BOUND = -0.15
# Held-out rows (heldout/*.json, mapped before their errors were computed; 2026-11-27): 26 stated/assumed rows,
# median 6.5%, max 43.2% (tt-mem-qlora-tut-llama2-7b-qlora-train: a reserved floor left by model loading), worst
# device-used -9.2% (peft-ds-lora-llama2-70b-zero3-8xh100); the band's top covers 25 of 26. Allocated rows
# (2026-11-28): signed median -0.9%, the bound +-2%.
HELD_OUT_MEDIAN_BOUND = 0.075
HELD_OUT_ALLOCATED_SIGNED_MEDIAN_BOUND = 0.02
HELD_OUT_MAX_BOUND = 0.44
HELD_OUT_DEVICE_USED_UNDER_BOUND = -0.18
HELD_OUT_TOP_COVERS_FLOOR = 0.95


@pytest.fixture(scope="module")
def result():
    return validate.run()


@pytest.fixture(scope="module")
def accuracy(result):
    """The fitting rows' figures (the held-out ones: test_held_out_rows_...)."""
    return validate.summary([r for r in validate.accuracy_rows(result) if r["split"] == "fitting"])


def test_every_row_is_mapped_or_excluded_with_a_reason(result):
    rows = validate.load_rows()
    assert sum(r["split"] == "fitting" for r in rows) == 51
    checked = {r["id"] for r in result["checked"]}
    excluded = {e["id"]: e["reason"] for e in result["excluded"]}
    assert checked | set(excluded) == {r["id"] for r in rows}
    assert not checked & set(excluded)
    assert all(len(reason) > 20 for reason in excluded.values())
    for row_id, (extra, note, basis) in validate.MAPPING.items():
        assert isinstance(extra, dict) and note and basis in ("stated", "assumed", "unresolved"), row_id
    # Rows the measurements file flags as suspect are never checked.
    for r in rows:
        if "SUSPECT" in r["notes"]:
            assert r["id"] in excluded, r["id"]


def test_full_rows_are_stated_and_partial_rows_are_not(result):
    completeness = {r["id"]: r["completeness"] for r in validate.load_rows()}
    for r in result["checked"]:
        assert (r["basis"] == "stated") == (completeness[r["id"]] == "full"), r["id"]


def test_coverage_at_least_20_checked_rows_from_5_families_with_nvidia_smi_rows(result, accuracy):
    assert accuracy["count"] >= 20
    assert len(accuracy["families"]) >= 5
    assert accuracy["device_used_count"] >= 1
    assert {r["metric"] for r in validate.accuracy_rows(result)} >= {"nvidia_smi", "max_memory_allocated",
                                                                    "max_memory_reserved"}


def test_architecture_chosen_by_the_tables_replaces_the_rows_own():
    rows = {r["id"]: r for r in validate.load_rows()}
    bert = validate.keywords(rows["bert-sdpa-pr-eager-b1-s256"])  # BertLMHeadModel: an MLM config, not bert-base
    assert "model" not in bert and bert["config"]["architectures"] == ["BertForMaskedLM"]
    tiny = validate.keywords(rows["litgpt-tinyllama-full-a10g"])  # the row's config -> the identical preset
    assert tiny["model"] == "tinyllama-1.1b" and "config" not in tiny


def test_calibration_names_its_term_and_is_not_checked(result):
    assert result["calibration"], "the HF doc's context measurement calibrates context_bytes"
    checked = {r["id"] for r in result["checked"]}
    for c in result["calibration"]:
        assert c["term"] and c["id"] not in checked
    # The calibrated context is the doc's 1343 MiB less the (1, 1) tensor's 2 MiB small-pool segment.
    assert validate.SOURCE_DEFAULTS["hf-perfone"][0]["context_bytes"] == (1343 - 2) * 2**20


def test_quoted_units_are_converted_as_sources_md_says():
    rows = {r["id"]: r for r in validate.load_rows()}
    # nvidia-smi "MB" are MiB: 14949 / 1024.
    assert rows["hf-perfone-bertlarge-fp32-b4"]["measured_gib"] == pytest.approx(14949 / 1024, abs=5e-4)
    # LitGPT prints max_memory_allocated / 1e9: 19.77 GB = 19.77e9 / 2**30 GiB.
    assert rows["litgpt-llama2-7b-lora-a10g"]["measured_gib"] == pytest.approx(19.77e9 / 2**30, abs=5e-4)
    # The BERT SDPA benchmark's MB taken as 1e6 bytes: 2123.874 MB.
    assert rows["bert-sdpa-pr-eager-b2-s512"]["measured_gib"] == pytest.approx(2123.874e6 / 2**30, abs=5e-4)


def test_each_metric_is_compared_with_its_figure(result):
    expected = {"max_memory_allocated": "allocated_peak", "peak_active": "allocated_peak",
                "max_memory_reserved": "reserved_peak", "nvidia_smi": "total_bytes"}
    for r in result["checked"]:
        assert r["figure"] == expected[r["metric"]], r["id"]
        b = r["breakdown_gib"]
        device = sum(b.values())
        if r["figure"] == "total_bytes":
            assert r["estimated_gib"] == pytest.approx(device)
        else:  # allocated and reserved leave the context (and NCCL) out
            assert r["estimated_gib"] < device - b["cuda_context"] + 1e-9
        assert r["low_gib"] <= r["estimated_gib"] <= r["high_gib"]


def test_signed_error_is_estimate_minus_measured_over_measured(result):
    for r in result["checked"]:
        assert r["error"] == pytest.approx((r["estimated_gib"] - r["measured_gib"]) / r["measured_gib"])


def test_accuracy_on_stated_and_assumed_rows(accuracy):
    assert accuracy["median_abs_error"] <= MEDIAN_ABS_ERROR_BOUND
    assert accuracy["max_abs_error"] <= MAX_ABS_ERROR_BOUND
    assert accuracy["worst_device_used_error"] >= DEVICE_USED_UNDER_BOUND
    assert accuracy["inside_band_share"] == 1.0  # the band's share above is set from these rows


def test_the_band_share_is_the_smallest_that_covers_every_fitting_row(result):
    """estimate.cpp's shares (25% above, 10% below): the fitting rows' largest needs rounded up to the next 5%
    (21.1% and 8.1% on 2026-11-28). A change of terms that moves a need past its share shows here."""
    fitting = [r for r in validate.accuracy_rows(result) if r["split"] == "fitting"]
    needs = validate.band_fractions(fitting)
    assert validate.BAND_ABOVE - 0.05 < needs["above"][0][0] <= validate.BAND_ABOVE
    assert validate.BAND_BELOW - 0.05 < needs["below"][0][0] <= validate.BAND_BELOW


def test_held_out_rows_are_a_third_marked_and_reported(result):
    rows = [r for r in validate.load_rows() if r["split"] != "issue_35"]  # the rows are neither
    held_out = [r for r in rows if r["split"] in ("held_out", "held_out_2")]
    assert len(held_out) >= len(rows) / 3
    assert all(r["added"] and r["source"] and r["quote"] for r in held_out)
    chosen = [r for r in validate.accuracy_rows(result) if r["split"] == "held_out"]
    s = validate.summary(chosen)
    assert s["median_abs_error"] <= HELD_OUT_MEDIAN_BOUND
    assert s["max_abs_error"] <= HELD_OUT_MAX_BOUND
    assert s["worst_device_used_error"] >= HELD_OUT_DEVICE_USED_UNDER_BOUND
    assert sum(r["measured_gib"] <= r["high_gib"] for r in chosen) / len(chosen) >= HELD_OUT_TOP_COVERS_FLOOR
    figures = {(f["split"], f["figure"]): f for f in validate.split_figures(validate.accuracy_rows(result))}
    assert all(figures[("held_out", figure)]["count"] > 0 for figure in ("allocated", "reserved", "device-used"))
    assert abs(figures[("held_out", "allocated")]["median_signed_error"]) <= HELD_OUT_ALLOCATED_SIGNED_MEDIAN_BOUND


def test_the_second_held_out_set_has_its_before_figures(result):
    """Issue 35's held-out set (heldout35/) was estimated before any of the issue's changes
    (heldout35_before.json, committed first): the same checked rows, and every figure has rows."""
    with open(os.path.join(os.path.dirname(validate.__file__), "heldout35_before.json")) as f:
        before = json.load(f)
    checked = {r["id"] for r in result["checked"] if r["split"] == "held_out_2"}
    assert {r["id"] for r in before["rows"] if r["split"] == "held_out_2"} == checked
    figures = {f["figure"]: f for f in before["figures"] if f["split"] == "held_out_2"}
    assert all(figures[figure]["count"] > 0 for figure in ("allocated", "reserved", "device-used"))
    rows = {r["id"]: r for r in validate.load_rows()}
    assert all(rows[i]["added"] == "2026-11-30" and rows[i]["quote"] for i in checked)


def test_unknown_values_are_refused_not_guessed():
    row = dict(validate.load_rows()[0])
    with pytest.raises(KeyError):
        validate.translate({**row, "precision": "fp8"})
    with pytest.raises(KeyError):
        validate.translate({**row, "optimizer": "lion"})
    with pytest.raises(ValueError, match="loss"):
        validate.translate({**row, "loss": "focal"})
    with pytest.raises(ValueError, match="LoRA targets"):
        validate.translate({**row, "lora": {"rank": 8, "targets": ["qkv_proj"], "base_dtype": "bf16",
                                            "double_quant": False, "dropout": 0.0}})
    with pytest.raises(KeyError, match="no source entry"):
        validate.source_of("unknown-source-row")


def test_a_row_neither_mapped_nor_excluded_is_an_error():
    rows = validate.load_rows()
    with pytest.raises(ValueError, match="neither"):
        validate.check_coverage(rows + [{**rows[0], "id": "hf-perfone-new-row"}])
    with pytest.raises(ValueError, match="unknown"):
        validate.check_coverage(rows[1:])


def test_json_and_docs_outputs(result, tmp_path):
    out = tmp_path / "r.json"
    assert validate.main(["--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {"calibration", "checked", "excluded", "summary"} <= set(data)
    doc = tmp_path / "estimator.md"
    doc.write_text(f"before\n{validate.BEGIN}\nold\n{validate.END}\nafter\n")
    validate.write_docs(result, str(doc))
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    assert "| hf-perfone-bertlarge-fp32-b4 |" in text
    doc.write_text("no markers\n")
    with pytest.raises(ValueError, match="markers"):
        validate.write_docs(result, str(doc))
