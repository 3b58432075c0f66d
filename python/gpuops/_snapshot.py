"""State of objects with state_dict/load_state_dict (model, optimizer, scaler), saved to host memory and put
back in place: used by the batch-size search (its trials train the model) and by TrainingState.load (a
state that does not fit must leave the objects as they were)."""

from __future__ import annotations

import io
from typing import Sequence

import torch


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


class StateSnapshot:
    """The state of objects with state_dict/load_state_dict, to be put back in place: values are saved to
    host memory and copied back into the very tensors that held them (the state_dicts reference them), so no
    allocation moves, and state created in between (optimizer moments) is dropped."""

    def __init__(self, objects: Sequence) -> None:
        self.live = [(o, o.state_dict()) for o in objects]
        self.buffer = io.BytesIO()
        torch.save([state for _, state in self.live], self.buffer)

    def restore(self) -> None:
        self.buffer.seek(0)
        saved = torch.load(self.buffer, weights_only=False)
        for (obj, live), values in zip(self.live, saved):
            _copy_into(live, values)
            obj.load_state_dict(live)
