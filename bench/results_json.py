"""The JSON a benchmark writes with --json (scripts/gpu-run reads it): a few headline figures for the run's
summary, every row measured, and where it ran."""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path
from typing import Optional

import torch


def where(device: str) -> dict:
    """The machine and software of a measurement."""
    on_gpu = device.startswith("cuda") and torch.cuda.is_available()
    return {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name() if on_gpu else platform.processor() or platform.machine()}


def write_json_atomically(path: str, document) -> None:
    """`document` as JSON in `path`, through a temporary file renamed over it: never a truncated file."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(document, indent=1) + "\n")
    os.replace(tmp, path)


def write(path: Optional[str], device: str, figures: dict, rows: list) -> None:
    """Writes {"figures", "rows", "where"} to `path`; no path, no file."""
    if path:
        write_json_atomically(path, {"figures": figures, "rows": rows, "where": where(device)})
