"""Fused optimizers: torch.optim-compatible classes over gpuops's fused kernels.

``gpuops.optim.AdamW`` (and ``Adam``) have torch's constructor, ``param_groups`` with per-group
options, ``zero_grad``, ``state_dict`` keys (``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``)
and work with torch's LR schedulers. One fused launch per parameter group and device. They declare
``_step_supports_amp_scaling``: a GradScaler (torch's or ours) hands them its scale and overflow flag,
and the step divides the gradients as it reads them and skips itself on overflow, on the device, with no
host sync.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Optional, Tuple

import torch

from . import _C  # noqa: F401  (loads libgpuops, which registers torch.ops.gpuops)


class Adam(torch.optim.Optimizer):
    """Adam with L2 weight decay (``weight_decay * param`` added to the gradient), fused."""

    _decoupled = False

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *, maximize: bool = False):
        if isinstance(lr, torch.Tensor) or not lr >= 0.0:
            raise ValueError(f"{type(self).__name__}: lr must be a float >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"{type(self).__name__}: betas must be in [0, 1), got {betas}")
        if not eps >= 0.0:
            raise ValueError(f"{type(self).__name__}: eps must be >= 0, got {eps}")
        if not weight_decay >= 0.0:
            raise ValueError(f"{type(self).__name__}: weight_decay must be >= 0, got {weight_decay}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=None, capturable=True, differentiable=False, fused=True)
        super().__init__(params, defaults)
        self._step_supports_amp_scaling = True

    def _init_state(self, param: torch.Tensor, amsgrad: bool) -> dict:
        state = self.state[param]
        if not state:
            # torch's layout: the step is a float32 scalar; on the parameter's device (capturable).
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale: Optional[torch.Tensor] = getattr(self, "grad_scale", None)
        found_inf: Optional[torch.Tensor] = getattr(self, "found_inf", None)
        for index, group in enumerate(self.param_groups):
            lists = defaultdict(lambda: ([], [], [], [], [], []))
            devices = set()
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise ValueError(f"{type(self).__name__}: param_groups[{index}] has a sparse gradient; "
                                     "use a dense one (e.g. nn.Embedding(sparse=False))")
                devices.add(param.device)
                state = self._init_state(param, group["amsgrad"])
                entry = lists[param.device]
                for target, value in zip(entry, (param, param.grad, state["exp_avg"], state["exp_avg_sq"],
                                                 state.get("max_exp_avg_sq"), state["step"])):
                    if value is not None:
                        target.append(value)
            if len(devices) > 1:
                raise ValueError(f"{type(self).__name__}: param_groups[{index}] has parameters on several devices "
                                 f"({sorted(str(d) for d in devices)}); put each device's parameters in its own "
                                 "optimizer")
            beta1, beta2 = group["betas"]
            for device, (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps) in lists.items():
                torch.ops.gpuops.adam_step_(
                    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, float(group["lr"]), beta1, beta2,
                    group["eps"], group["weight_decay"], self._decoupled, group["amsgrad"], group["maximize"],
                    None if grad_scale is None else grad_scale.to(device, non_blocking=True),
                    None if found_inf is None else found_inf.to(device, non_blocking=True))
        return loss


class AdamW(Adam):
    """AdamW (decoupled weight decay, default 1e-2 as torch's), fused."""

    _decoupled = True

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize)
