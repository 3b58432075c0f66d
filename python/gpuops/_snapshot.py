"""State of objects with state_dict/load_state_dict (model, optimizer, scaler), saved to host memory and put
back in place: used by the batch-size search (its trials train the model) and by TrainingState.load (a
state that does not fit must leave the objects as they were)."""

from __future__ import annotations

import io
from typing import Sequence

import torch

from . import _C


def _copy_into(live, saved) -> None:
    """Copies the tensors of `saved` into the tensors at the same places in `live` (dicts, lists, tuples)."""
    if isinstance(live, torch.Tensor):
        with torch.no_grad():
            live.copy_(saved)
    elif isinstance(live, dict):
        for key in live:
            _copy_into(live[key], saved[key])
    elif isinstance(live, (list, tuple)):
        for a, b in zip(live, saved):
            _copy_into(a, b)


def _host_copy(t):
    return None if t is None else t.detach().to("cpu", copy=True)


class StateSnapshot:
    """The state of objects with state_dict/load_state_dict, to be put back in place: values are saved to
    host memory and copied back into the very tensors that held them (the state_dicts reference them), so no
    allocation moves, and state created in between (optimizer moments) is dropped. An object with
    ``_local_snapshot()`` / ``_local_restore(saved)`` (gpuops.ZeroOptimizer: each rank's shard) saves and puts
    back itself, after the others. A module's parameters' gradients are put back too (None stays None: a
    trial's gradients do not outlive it).

    ``restore`` allocates nothing under a memory_budget (it runs in ``_C.unbudgeted()`` and loads to the
    host), so undoing a search cannot fail for the memory the search measured; it puts back every object it
    can and then raises the first error."""

    def __init__(self, objects: Sequence) -> None:
        for i, o in enumerate(objects):
            if not (callable(getattr(o, "state_dict", None)) and callable(getattr(o, "load_state_dict", None))):
                raise TypeError(f"restore[{i}] must have state_dict() and load_state_dict() (a module, an "
                                f"optimizer, a GradScaler), got {type(o).__name__}")
        # A sharded optimizer holds only this rank's part: it snapshots that itself (no consolidation), and a
        # stage-3 model's parameters live in it (its state_dict leaves them out, quietly here).
        self.local = [(o, o._local_snapshot()) for o in objects if callable(getattr(o, "_local_snapshot", None))]
        quiet = [(o, getattr(o, "_quiet_state_dict", False)) for o, _ in self.local]
        for o, _ in quiet:
            o._quiet_state_dict = True
        try:
            self.live = [(o, o.state_dict()) for o in objects if not callable(getattr(o, "_local_snapshot", None))]
        finally:
            for o, before in quiet:
                o._quiet_state_dict = before
        self.grads = [(p, _host_copy(p.grad)) for o in objects if isinstance(o, torch.nn.Module)
                      for p in o.parameters()]
        self.buffer = io.BytesIO()
        torch.save([state for _, state in self.live], self.buffer)

    def restore(self) -> None:
        first_error = None
        with _C.unbudgeted():
            self.buffer.seek(0)
            saved = torch.load(self.buffer, map_location="cpu", weights_only=False)  # our own bytes
            for (obj, live), values in zip(self.live, saved):
                try:
                    _copy_into(live, values)
                    obj.load_state_dict(live)
                except Exception as error:  # noqa: BLE001 - the others are put back first
                    first_error = first_error or error
            for p, grad in self.grads:
                if grad is None:
                    p.grad = None
                elif p.grad is not None and p.grad.shape == grad.shape and p.grad.dtype == grad.dtype:
                    with torch.no_grad():
                        p.grad.copy_(grad)
                else:
                    p.grad = grad.to(p.device)
            for obj, saved in self.local:  # (collective for a sharded optimizer: every rank restores)
                try:
                    obj._local_restore(saved)
                except Exception as error:  # noqa: BLE001 - as above
                    first_error = first_error or error
        if first_error is not None:
            raise first_error
