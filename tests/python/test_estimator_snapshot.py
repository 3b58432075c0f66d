"""The estimator's figures over a fixed spread of models and setups (every setup feature alone and in mixes, on
the CPU and two CUDA profiles, and every mapped published row) equal tests/data/estimator_snapshot.json. A
restructure must leave them as they are; a change of terms rewrites the file in the same commit
(`bench/estimator_validation/snapshot.py --write`), whose message names the cause."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "estimator_validation"))
import snapshot  # noqa: E402


def test_every_estimate_is_as_stored():
    with open(snapshot.PATH) as f:
        stored = json.load(f)
    differences = snapshot.differences(stored, snapshot.current())
    assert not differences, (f"{len(differences)} estimates differ from tests/data/estimator_snapshot.json "
                             "(a change of terms: bench/estimator_validation/snapshot.py --write):\n"
                             + "\n".join(differences[:20]))


def test_the_spread_covers_every_feature_and_refusals():
    with open(snapshot.PATH) as f:
        stored = json.load(f)
    assert len(stored) >= 1000
    refused = [v for v in stored.values() if "refused" in v]
    assert 0 < len(refused) < len(stored) / 10  # refusals are behaviour too, but most setups estimate
    phases = {v["peak_phase"] for v in stored.values() if "peak_phase" in v}
    assert len(phases) >= 4
