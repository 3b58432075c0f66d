"""`python -m gpuops.metrics plot run/metrics.jsonl -o run.png`: the records of a run as one picture (loss, loss
scale with the skipped steps marked, gradient norm, tokens/s and peak memory over the steps)."""

from __future__ import annotations

import json
import os
import warnings
from typing import Dict, List


def read_records(path: str) -> List[Dict]:
    """The records of a JSON Lines file; a line that is not a record is an error naming it. A last line without
    its newline is a write a kill cut short (the recorder cuts it off when it reopens the file): skipped, with a
    warning."""
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.endswith("\n"):
                warnings.warn(f"{path}:{number}: an unfinished last line (a write cut by a kill) is skipped")
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number} is not a JSON record ({e.msg}); accepted: the JSON Lines file "
                                 "a gpuops.metrics.Recorder writes") from None
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError(f"{path}:{number} has no integer 'step'; accepted: gpuops.metrics records")
            records.append(record)
    if not records:
        raise ValueError(f"{path} holds no records")
    return records


def plot(path: str, out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_records(path)
    steps = [r["step"] for r in records]

    def series(name):
        return [r.get(name) if r.get(name) is not None else float("nan") for r in records]

    panels = [("loss", ["loss", "loss_last"], "linear"), ("loss scale", ["loss_scale"], "log"),
              ("gradient norm", ["grad_norm", "grad_norm_max"], "linear"), ("tokens/s", ["tokens_per_s"], "linear"),
              ("peak memory (GiB)", ["peak_allocated_bytes", "peak_reserved_bytes"], "linear")]
    # a figure the run did not report (no scaler, the CPU's memory) gets no panel; the loss always has one
    panels = [p for p in panels if p[0] == "loss" or any(v == v for n in p[1] for v in series(n))]
    figure, axes = plt.subplots(len(panels), 1, figsize=(8, 2.2 * len(panels)), sharex=True, squeeze=False)
    axes = axes[:, 0]
    for axis, (title, names, scale) in zip(axes, panels):
        for name in names:
            values = series(name)
            if name.endswith("_bytes"):
                values = [v / 2**30 for v in values]
            axis.plot(steps, values, marker=".", label=name)
        if title == "loss scale":  # the records where the skipped count grew
            skipped = series("skipped_steps")
            marks = [s for s, before, now in zip(steps[1:], skipped, skipped[1:]) if now > before]
            marks += [steps[0]] if skipped and skipped[0] and skipped[0] > 0 else []
            for step in marks:
                axis.axvline(step, color="tab:red", alpha=0.3)
        axis.set_yscale(scale if any(v == v and v > 0 for v in series(names[0])) else "linear")
        axis.set_title(title, fontsize=9)
        axis.legend(fontsize=7)
    axes[-1].set_xlabel("optimizer step")
    figure.suptitle(os.path.basename(path), fontsize=10)
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out
