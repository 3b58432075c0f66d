"""Gradient accumulation normalised by the true count of a window (issue: accumulation).

A window of ``window`` micro-batches makes one optimizer step. Each micro-batch hands in the SUM of its
per-sample (or per-token) losses and how many samples (tokens) that sum covers; the window's gradient is
the sum over the window divided by the window's total count: the mean over every sample of the window,
never a mean of per-micro-batch means (the bug Hugging Face fixed with ``num_items_in_batch``). The count
is only known at the window's end, so the summed losses are back-propagated as they come and 1/count is
folded into the scaler's gradient factor: the division rides on the unscale / clip / fused-step pass, at
no extra pass and, with a device tensor count, no host sync. A short last window (end of an epoch) is
stepped by ``flush()`` with its own count.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from . import _C
from .amp import GradScaler


class GradAccumulator:
    """Accumulates ``window`` micro-batches per optimizer step.

    ``scaler``: a GradScaler for fp16 (ours, or None); the loss is scaled once per micro-batch and the
    scaler unscales once per window, so an overflow anywhere in the window skips the window's step. Without
    an enabled scaler an internal one with a fixed scale of 1 does the same bookkeeping (it still skips a
    window with inf/nan gradients). ``max_norm``: clip the window's mean gradient (L2) before the step.
    ``on_boundary``: called before each step, e.g. for a sharded optimizer to reduce its gradients.

    ``last_grad_norm``: with ``max_norm``, the L2 norm of the last window's mean gradient before clipping (a
    0-dim tensor on the gradients' device, not read on the host: hand it to a Recorder's ``grad_norm``, or
    ``.item()`` it when you log); None before the first step and without ``max_norm``. As C++'s
    ``GradAccumulator::last_grad_norm()``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, window: int, scaler: Optional[GradScaler] = None, *,
                 max_norm: Optional[float] = None, on_boundary: Optional[Callable[[], None]] = None) -> None:
        _C.check_grad_accumulator_options(window, max_norm)  # the C++ accumulator's rules and messages
        if not hasattr(optimizer, "param_groups") or not callable(getattr(optimizer, "step", None)):
            raise TypeError("GradAccumulator: optimizer must be a torch.optim.Optimizer (param_groups and step()), "
                            f"got {type(optimizer).__name__}")
        if on_boundary is not None and not callable(on_boundary):
            raise TypeError(f"GradAccumulator: on_boundary must be callable or None, got {type(on_boundary).__name__}")
        if scaler is not None and not isinstance(scaler, GradScaler):
            raise ValueError("GradAccumulator: scaler must be a gpuops.GradScaler (it folds 1/count into the "
                             f"unscale pass), got {type(scaler).__name__}")
        self.optimizer = optimizer
        self.window = window
        self.max_norm = max_norm
        self.on_boundary = on_boundary
        self._user_scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self._unit_scaler: Optional[GradScaler] = None
        self._count: Optional[torch.Tensor] = None
        self._micro_batches = 0
        self.last_grad_norm: Optional[torch.Tensor] = None  # with max_norm: the window's mean-gradient norm

    @property
    def micro_batches(self) -> int:
        """Micro-batches back-propagated in the current window."""
        return self._micro_batches

    def _scaler_for(self, device: torch.device) -> GradScaler:
        if self._user_scaler is not None:
            return self._user_scaler
        if self._unit_scaler is None:  # scale fixed at 1: only the divisor and the inf/nan skip remain
            self._unit_scaler = GradScaler(device.type, init_scale=1.0, min_scale=1.0, max_scale=1.0)
        return self._unit_scaler

    def backward(self, loss_sum: torch.Tensor, count: Union[int, float, torch.Tensor]) -> bool:
        """Back-propagates ``loss_sum`` (the sum of this micro-batch's per-sample losses) and adds ``count``
        (the samples or tokens it covers) to the window. Returns True when this micro-batch completed the
        window and the optimizer stepped."""
        # gpuops::check_micro_batch: loss_sum one floating value that requires grad; count a finite number > 0
        # (a device tensor's value is not read: no sync) on the CPU or loss_sum's device.
        _C.check_micro_batch(loss_sum, count)
        count = torch.as_tensor(count, dtype=torch.float32, device=loss_sum.device).reshape(1)
        total = count if self._count is None else self._count + count.to(self._count.device)
        self._scaler_for(loss_sum.device).scale(loss_sum).backward()
        self._count = total  # only once backward went through: a failed call changes nothing
        self._micro_batches += 1
        # >=: a window whose step failed (on_boundary or the optimizer raised) stays pending and steps at the next
        # micro-batch (or flush()), its mean over every sample still exact; == would never step again.
        if self._micro_batches >= self.window:
            self._step()
            return True
        return False

    def flush(self) -> bool:
        """Steps on a short last window (end of an epoch); returns whether there was one."""
        if self._micro_batches == 0:
            return False
        self._step()
        return True

    def _step(self) -> None:
        if self.on_boundary is not None:
            self.on_boundary()
        scaler = self._scaler_for(self._count.device)
        scaler.set_grad_divisor(self.optimizer, self._count)
        if self.max_norm is not None:
            self.last_grad_norm = scaler.clip_grad_norm_(self.optimizer, self.max_norm)
        scaler.step(self.optimizer)
        scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self._count = None
        self._micro_batches = 0
