"""The estimator against measured memory: real CPU training steps of Hugging Face models under
gpuops.memory_budget, compared with gpuops.estimate(..., device="cpu").

    .venv/bin/python bench/estimator_validation/validate.py          # run the grid, write docs/estimator.md's table

tests/python/test_estimator_validation.py runs the same grid and asserts the error bounds.
"""

from __future__ import annotations

import datetime
import itertools
import os
import platform
import re
import statistics
import sys
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gpuops  # noqa: E402
from measure import (lora_model_factory_for, make_config, measure_peak, model_factory_for,  # noqa: E402
                     optimizer_factory_for)

# Small configs of both families: GQA and SwiGLU (Llama), tied and untied embeddings, GPT-2 with dropout and
# with a custom MLP width. None of these is a config the formulas were derived on (run_grid.py's CONFIGS).
MODELS = {
    "llama-gqa-untied": ("llama", dict(h=128, L=3, a=8, kv=2, i=344, V=4000, tied=False)),
    "llama-tied": ("llama", dict(h=192, L=2, a=6, kv=6, i=512, V=6000, tied=True)),
    "llama-mqa-wide": ("llama", dict(h=256, L=2, a=4, kv=1, i=704, V=7000, tied=False)),
    "gpt2-tied": ("gpt2", dict(h=128, L=4, a=8, V=4000, tied=True)),
    "gpt2-dropout": ("gpt2", dict(h=96, L=3, a=4, V=3000, tied=True, dropout=0.1)),
    "gpt2-untied-inner": ("gpt2", dict(h=160, L=2, a=5, i=480, V=5000, tied=False)),
}
SHAPES = [(2, 64), (4, 128)]
PRECISIONS = ["fp32", "bf16-mixed", "bf16"]
OPTIMIZERS = ["adamw", "sgd-momentum"]
CHECKPOINTING = [False, True]
ATTENTION = ["sdpa", "eager"]


@dataclass(frozen=True)
class Case:
    model: str
    batch: int
    seq: int
    precision: str
    optimizer: str
    checkpointing: bool
    attention: str

    def label(self) -> str:
        return (f"{self.model} b{self.batch} s{self.seq} {self.precision} {self.optimizer} "
                f"{'ckpt' if self.checkpointing else 'no-ckpt'} {self.attention}")


def grid() -> list[Case]:
    """Every model, precision and checkpointing choice; shapes, optimizers and attention alternate."""
    cases = []
    for k, (model, precision, checkpointing) in enumerate(itertools.product(MODELS, PRECISIONS, CHECKPOINTING)):
        for j, (batch, seq) in enumerate(SHAPES):
            cases.append(Case(model, batch, seq, precision, OPTIMIZERS[(k + j) % len(OPTIMIZERS)], checkpointing,
                              ATTENTION[(k // 2 + j) % len(ATTENTION)]))
    return cases


def measure(case: Case) -> int:
    return measure_case(case)["peak"]


def estimate(case: Case) -> gpuops.Breakdown:
    return estimate_case(case)


def run(cases: list[Case]) -> list[dict]:
    rows = []
    for case in cases:
        measured = measure(case)
        estimated = estimate(case).total_bytes
        rows.append({"case": case, "measured": measured, "estimated": estimated,
                     "error": (estimated - measured) / measured})
    return rows


# ---- LoRA (PEFT): held-out configs (the LoRA terms were derived on run_grid's llama-A/B shapes and
# h=128 L=3 kv=2 in FINDINGS.md "LoRA (PEFT)"). precision fp32: an fp32 base (base_dtype="fp32");
# bf16-mixed: a bf16 base with PEFT's fp32 adapters under autocast; bf16: the whole PeftModel cast to bf16.
LORA_MODELS = {
    "llama-tied": MODELS["llama-tied"],
    "llama-mqa-wide": MODELS["llama-mqa-wide"],
}
LORA_TARGETS = {"llama": [("q", "v"), ("q", "k", "v", "o", "gate", "up", "down")], "gpt2": [("o", "up", "down")]}
LORA_RANKS = [8, 64]
LORA_DROPOUTS = [0.0, 0.1]


@dataclass(frozen=True)
class LoraCase:
    model: str
    precision: str
    checkpointing: bool
    attention: str
    targets: tuple
    rank: int
    dropout: float
    batch: int = 2
    seq: int = 64
    optimizer: str = "adamw"

    def label(self) -> str:
        return (f"LoRA {self.model} r{self.rank} {','.join(self.targets)} drop{self.dropout} b{self.batch} "
                f"s{self.seq} {self.precision} {'ckpt' if self.checkpointing else 'no-ckpt'} {self.attention}")


def lora_grid() -> list[LoraCase]:
    """Every model x precision x checkpointing x target set; rank, dropout and attention alternate."""
    cases = []
    k = 0
    for model, (kind, _) in LORA_MODELS.items():
        for precision, checkpointing, targets in itertools.product(PRECISIONS, CHECKPOINTING, LORA_TARGETS[kind]):
            cases.append(LoraCase(model, precision, checkpointing, ATTENTION[(k // 2) % 2], targets,
                                  LORA_RANKS[k % 2], LORA_DROPOUTS[(k // 3) % 2]))
            k += 1
    return cases


def measure_lora(case: LoraCase) -> int:
    return measure_case(case)["peak"]


def estimate_lora(case: LoraCase) -> gpuops.Breakdown:
    return estimate_case(case)


def measure_case(case, models: dict = MODELS, device: str = "cpu", meter: str = "gpuops") -> dict:
    """measure_peak's result for a Case or a LoraCase whose model is in `models`."""
    kind, cfg = models[case.model]
    if isinstance(case, LoraCase):
        factory = lora_model_factory_for(kind, cfg, case.attention, case.rank, case.targets, case.dropout,
                                         base="bf16" if case.precision == "bf16-mixed" else "fp32",
                                         checkpointing=case.checkpointing)
        # precision "bf16" casts the PeftModel (adapters included) to bf16 inside measure_peak; the
        # checkpointing is PEFT's, set up by the factory.
        return measure_peak(factory, optimizer_factory_for(case.optimizer), case.batch, case.seq, case.precision,
                            False, meter=meter, device=device)
    return measure_peak(model_factory_for(kind, cfg, case.attention), optimizer_factory_for(case.optimizer),
                        case.batch, case.seq, case.precision, case.checkpointing, meter=meter, device=device)


def estimate_case(case, models: dict = MODELS, device: str = "cpu", **cuda) -> gpuops.Breakdown:
    """gpuops.estimate of a Case or a LoraCase; `cuda`: estimate()'s CUDA keywords (gpu, device_profile)."""
    kind, cfg = models[case.model]
    lora = {}
    if isinstance(case, LoraCase):
        lora = dict(lora_rank=case.rank, lora_targets=list(case.targets), lora_dropout=case.dropout,
                    base_dtype="fp32" if case.precision == "fp32" else "bf16")
    return gpuops.estimate(config=make_config(kind, cfg, case.attention).to_dict(), precision=case.precision,
                           optimizer=case.optimizer, checkpointing="full" if case.checkpointing else "none",
                           attention=case.attention, micro_batch=case.batch, seq_len=case.seq, device=device,
                           **lora, **cuda)


def run_lora(cases: list[LoraCase]) -> list[dict]:
    rows = []
    for case in cases:
        measured = measure_lora(case)
        estimated = estimate_lora(case).total_bytes
        rows.append({"case": case, "measured": measured, "estimated": estimated,
                     "error": (estimated - measured) / measured})
    return rows


def summary(rows: list[dict]) -> dict:
    errors = [abs(r["error"]) for r in rows]
    return {"cases": len(rows), "max": max(errors), "median": statistics.median(errors),
            "mean": statistics.fmean(errors)}


def markdown(rows: list[dict]) -> str:
    stats = summary(rows)
    lines = [
        f"Measured on {platform.machine()} CPU ({os.cpu_count()} cores), {datetime.date.today()}, torch "
        f"{__import__('torch').__version__}, transformers {__import__('transformers').__version__}: "
        f"{stats['cases']} cases, |error| max {100 * stats['max']:.2f}%, median {100 * stats['median']:.3f}%, "
        f"mean {100 * stats['mean']:.3f}%.",
        "",
        "| case | measured MiB | estimated MiB | error |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['case'].label()} | {r['measured'] / 2**20:.3f} | {r['estimated'] / 2**20:.3f} | "
                     f"{100 * r['error']:+.2f}% |")
    return "\n".join(lines) + "\n"


def write_docs(rows: list[dict], path: str = os.path.join(HERE, "..", "..", "docs", "estimator.md")) -> None:
    """Replaces the text between the validation markers of docs/estimator.md."""
    begin, end = "<!-- validation-table:begin -->", "<!-- validation-table:end -->"
    text = open(path).read()
    block = f"{begin}\n{markdown(rows)}{end}"
    if begin in text:
        text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text += f"\n## Validation against measured memory (CPU)\n\n{block}\n"
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    if "--lora" in sys.argv:  # the LoRA table only (printed, docs untouched)
        print(markdown(run_lora(lora_grid())))
        sys.exit(0)
    rows = run(grid())
    print(markdown(rows))
    write_docs(rows)
