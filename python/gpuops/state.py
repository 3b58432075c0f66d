"""Offline export of a gpuops.TrainingState saved with a sharded optimizer: the model's full state_dict, which a
plain (unsharded) model loads, written without launching a ZeRO job (DeepSpeed users know this as
zero_to_fp32.py):

    python -m gpuops.state export FOLDER model.pt

The newest good state of FOLDER is read: its state.pt (the model's unsharded entries) and every rank's shard
file (stage 3's parameters, and the fp32 masters of 16-bit parameters at stages 1 and 2, read by the C++ engine,
gpuops::optim::read_full_parameters). Sharded parameters come out in fp32; tied ones under each of their keys.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Dict

import torch

from . import _C


def export(folder, out) -> Dict[str, torch.Tensor]:
    """Writes the full model state_dict of FOLDER's newest good state to ``out`` (atomically: complete or absent)
    and returns it. ValueError when the folder holds no state, or one saved without a sharded optimizer."""
    from .training_state import TrainingState

    if not Path(folder).is_dir():
        raise ValueError(f"gpuops.state export: {folder} is not a folder")
    target = Path(out)
    if target.is_symlink() or (target.exists() and not target.is_file()):  # a rename would replace it with a file
        raise ValueError(f"gpuops.state export: {out} is not a regular file (a symbolic link, folder, FIFO or "
                         "device); accepted: a new path, or a regular file to replace")
    state = TrainingState(folder, signals=())
    try:
        stored, payload = state._newest_good(map_location="cpu")
    finally:
        state.close()
    if stored is None:
        raise ValueError(f"gpuops.state export: {folder} holds no training state")
    if "sharded_optimizer" not in payload:
        raise ValueError(f"gpuops.state export: {stored.path} was saved without a sharded optimizer: its state.pt "
                         "holds the whole model already (TrainingState.load(model=...), or torch.load it)")
    by_name = dict(_C.read_full_parameters(_C.shard_files_of(stored)))
    full = dict(payload.get("model") or {})
    keys = payload.get("sharded_names") or {}  # stage 3: each key the model left out -> its parameter's name
    missing = sorted(set(keys.values()) - set(by_name))
    if missing:
        raise ValueError(f"gpuops.state export: the shard files of {stored.path} lack {missing[:3]}")
    for key, name in keys.items():
        full[key] = by_name[name]
    if not keys:  # stages 1 and 2 (the model is whole in state.pt: 16-bit parameters get their fp32 masters)
        full.update(by_name)
    tmp = Path(f"{out}.tmp-{os.getpid()}")
    try:
        torch.save(full, tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return full


def _main(argv) -> int:
    if len(argv) != 3 or argv[0] != "export":
        print("usage: python -m gpuops.state export FOLDER OUT.pt", file=sys.stderr)
        return 2
    try:
        full = export(argv[1], argv[2])
    except (ValueError, OSError) as e:
        print(f"gpuops.state: error: {e}", file=sys.stderr)
        return 1
    count = sum(t.numel() for t in full.values() if isinstance(t, torch.Tensor))
    print(f"gpuops.state: wrote {len(full)} entries ({count:,} values) to {argv[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
