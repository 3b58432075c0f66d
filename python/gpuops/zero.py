"""gpuops.ZeroOptimizer: ZeRO stages 1 and 2 (issue 13, part 2) over a communicator.

    import torch.distributed as dist, gpuops
    dist.init_process_group("gloo")                    # torchrun, or any launcher
    opt = gpuops.ZeroOptimizer(model.parameters(), stage=2, lr=1e-3)   # the default group
    scaler = gpuops.GradScaler("cpu")
    for x, y in data:
        opt.zero_grad()
        scaler.scale(loss_fn(model(x), y)).backward()
        scaler.clip_grad_norm_(opt, 1.0)               # the global norm, over every rank's shard
        scaler.step(opt)                               # reduce-scatter, fused AdamW on the shard, all-gather
        scaler.update()

The work is done by the C++ class ``gpuops::optim::ZeroOptimizer`` (``gpuops._C.ZeroOptimizer``); this
class only adds what torch.optim code and our GradScaler look for: ``param_groups`` (one group, whose
``params`` are this rank's shard parameters: their ``.grad`` is the reduced gradient shard), ``step``,
``zero_grad`` and the AMP hand-off (``_step_supports_amp_scaling``). The model's parameters become views of
flat buffers padded to a multiple of the world size; every rank must pass the same parameters.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from . import _C
from . import dist as _dist


class ZeroOptimizer:
    """AdamW with its state (and the gradients, stage 2) sharded over the ranks of ``communicator``
    (a ``gpuops.dist.Communicator``; None: one over torch.distributed's default group)."""

    _step_supports_amp_scaling = True  # GradScaler hands over grad_scale and found_inf, no host sync

    def __init__(self, params, communicator: Optional[_C.Communicator] = None, stage: int = 1, lr: float = 1e-3,
                 betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2):
        if communicator is None:
            communicator = _dist.Communicator()
        if not isinstance(communicator, _C.Communicator):
            raise TypeError("gpuops.ZeroOptimizer: communicator must be a gpuops.dist.Communicator or None, got "
                            f"{type(communicator).__name__}")
        self._impl = _C.ZeroOptimizer(params, communicator, stage, lr, betas, eps, weight_decay)
        self.communicator = communicator
        self.defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        self.param_groups = [dict(self.defaults, params=self._impl.shard_params())]
        self.state: dict = {}  # the state lives in C++ (state_bytes()); checkpoints are not built yet

    @property
    def stage(self) -> int:
        return self._impl.stage

    def step(self, closure: Optional[Callable[[], Any]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._impl.lr = self.param_groups[0]["lr"]  # an LR scheduler writes the group's lr
        self._impl.step(getattr(self, "grad_scale", None), getattr(self, "found_inf", None))
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the flat gradients (stage 2: allocates them again) for the next backward."""
        self._impl.zero_grad()

    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer state tensors."""
        return self._impl.state_bytes()

    def gradient_bytes(self) -> int:
        """Bytes of the gradient buffers this rank holds now."""
        return self._impl.gradient_bytes()

    def flat_numels(self) -> list:
        """Elements of each flat buffer, padding included (every rank owns 1/world_size of each)."""
        return self._impl.flat_numels()

    # GradScaler's hooks for sharded optimizers: reduce before the gradients are read; one flag, one norm.
    def _gpuops_prepare_gradients(self) -> None:
        self._impl.prepare_gradients()

    def _gpuops_global_found_inf(self, found_inf: torch.Tensor) -> torch.Tensor:
        return self._impl.global_found_inf(found_inf)

    def _gpuops_global_grad_norm(self, norm: torch.Tensor) -> torch.Tensor:
        return self._impl.global_grad_norm(norm)


__all__ = ["ZeroOptimizer"]
