"""The estimator's core reads no option that a setup feature owns: each feature's terms live in its unit,
src/estimator/features/<name>.cpp (docs/architecture.md, "The estimator's setup features, one place each").
Option parsing and ranges (training_setup.cpp) and the advisor, which writes alternative setups (advise.cpp),
name the options by design."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORE = ROOT / "src" / "estimator"
# TrainingSetup fields that belong to a feature unit.
FEATURE_OPTIONS = ["lora", "lora_dropout", "compile", "checkpoint", "checkpoint_every_k", "loss", "loss_chunks",
                   "held_logits", "model_code", "offload_optimizer", "sharding", "reshard_after_forward",
                   "zero_prefetch", "reduce_dtype", "zero_reduce_at_step", "zero_bucket_bytes", "ds_reduce_bucket",
                   "loss_upcast", "fsdp_orig_params"]
NAMING_BY_DESIGN = {"training_setup.cpp", "advise.cpp"}
READ = re.compile(r"\b(?:s|t|setup)\.(" + "|".join(FEATURE_OPTIONS) + r")\b")


def test_the_core_reads_no_feature_option():
    reads = []
    for path in sorted(CORE.glob("*.cpp")) + sorted(CORE.glob("*.h")):
        if path.name in NAMING_BY_DESIGN:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in READ.finditer(line.split("//")[0]):
                reads.append(f"{path.name}:{number}: {match.group(0)}")
    assert not reads, "the estimator's core reads feature options (move the term into its unit):\n" + "\n".join(reads)


def test_every_feature_unit_is_registered():
    units = {p.stem for p in (CORE / "features").glob("*.cpp")} - {"features"}
    registry = (CORE / "features" / "features.cpp").read_text()
    cmake = (ROOT / "CMakeLists.txt").read_text()
    for unit in units:
        assert f"&{unit}_feature()" in registry, f"features/{unit}.cpp is not in the registry (features.cpp)"
        assert f"src/estimator/features/{unit}.cpp" in cmake, f"features/{unit}.cpp is not built (CMakeLists.txt)"
