"""Fused optimizers: torch.optim-compatible classes over gpuops's fused kernels.

``gpuops.optim.AdamW``, ``Adam`` and ``SGD`` have torch's constructors, ``param_groups`` with per-group
options, ``zero_grad``, ``state_dict`` keys (``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``)
and work with torch's LR schedulers. ``lr`` may be a one-element float32 tensor on the parameters' device:
the step then reads it on the device, so a step captured in a CUDA graph follows the scheduler. They step
float16/bfloat16 parameters on an fp32 master copy (state ``master_param``, with fp32 moments / momentum)
and round the result into the parameter. One fused launch per parameter group and device. They declare
``_step_supports_amp_scaling``: a GradScaler (torch's or ours) hands them its scale and overflow flag,
and the step divides the gradients as it reads them and skips itself on overflow, on the device, with no
host sync.
"""

from __future__ import annotations

import itertools
from typing import Dict, Iterable, Tuple, Union

import torch

from . import _C  # also loads libgpuops, which registers torch.ops.gpuops


_HALF_DTYPES = (torch.float16, torch.bfloat16)
_Lr = Union[float, torch.Tensor]


def _host_lr(where: str, lr, read_tensor: bool):
    """The lr value the option checks take. lr: a number, or a one-element float32 tensor holding one (read on
    the device at each step, so a step captured in a CUDA graph follows an LR scheduler, which writes such a
    tensor in place). A tensor's value is read only when read_tensor (at construction and load: reading it at
    every step would sync); else 0.0 stands in for it."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{where}: Tensor lr must be 1-element, got {lr.numel()} elements")
        if lr.dtype != torch.float32:
            raise ValueError(f"{where}: a tensor lr must be a one-element float32 tensor, got {lr.dtype}")
        return float(lr.item()) if read_tensor else 0.0
    return lr


def _is_non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """The elements fill one block of memory (contiguous, channels_last, transposed...): the fused steps go
    over that block linearly, so such a tensor and its gradient and state need the same strides."""
    if t.numel() == 0:
        return True
    expected = 1
    for size, stride in sorted(((n, st) for n, st in zip(t.shape, t.stride()) if n != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _lr_arguments(group: dict) -> tuple:
    """(host lr, device lr tensor or None) for the fused ops; a tensor lr replaces the host one."""
    lr = group["lr"]
    return (0.0, lr.reshape(1)) if isinstance(lr, torch.Tensor) else (float(lr), None)


class _FusedOptimizer(torch.optim.Optimizer):
    """What the fused optimizers share: the AMP hand-off and the per-device tensor lists of a group."""

    _fp32_state_keys: Tuple[str, ...] = ()  # state kept in float32 for 16-bit parameters
    # A class attribute, so that copies (deepcopy, pickle) keep the sync-free hand-off to GradScaler.
    _step_supports_amp_scaling = True

    def __init__(self, params: Iterable, defaults: dict):
        defaults = dict(defaults, foreach=None, capturable=True, differentiable=False, fused=True)
        super().__init__(params, defaults)

    def _amp_inputs(self, device: torch.device):
        """A GradScaler's scale and overflow flag (set on the optimizer during its step), on `device`."""
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        return (None if grad_scale is None else grad_scale.to(device, non_blocking=True),
                None if found_inf is None else found_inf.to(device, non_blocking=True))

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load_state_dict, transactional: the whole state_dict is checked first (group count and sizes
        with torch's messages, every group's options as the constructor checks them, every state entry: its key a
        parameter of a group, ``step`` one finite number >= 0, its tensors floating with the parameter's shape),
        and a failure after that restores the optimizer as it was. Then, as torch casts every floating state
        tensor to its parameter's dtype, a 16-bit parameter's master copy and moments are made float32 again
        (state saved by torch's own 16-bit optimizers is widened). Older or non-fused torch checkpoints: missing
        option keys take our defaults (as torch's own __setstate__ does) and ``step`` becomes our float32 counter
        on the parameter's device (torch keeps a non-fused optimizer's step on the CPU, or as an int before
        torch 1.12)."""
        id_map = self._checked_id_map(state_dict)
        before = (self.state, self.param_groups)  # torch's load replaces both objects: restoring them undoes it
        try:
            super().load_state_dict(state_dict)
            for group in self.param_groups:
                for key, value in self.defaults.items():
                    group.setdefault(key, value)
            for key, saved in state_dict["state"].items():
                self._adapt_loaded_state(id_map[key], saved)
        except BaseException:
            self.state, self.param_groups = before
            raise
        # Loaded masters are checked against their parameters at the next step, whatever the versions say.
        self.__dict__.pop("_master_versions", None)

    def _checked_id_map(self, state_dict) -> dict:
        """Checks everything load_state_dict will use; returns {saved parameter id: parameter}."""
        where = f"{type(self).__name__}.load_state_dict"
        if (not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict)
                or not isinstance(state_dict.get("param_groups"), (list, tuple))):
            raise ValueError(f"{where}: expected a dict with 'state' (a dict) and 'param_groups' (a list), as "
                             f"state_dict() returns; got {type(state_dict).__name__}")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has a different number of parameter groups ({len(saved_groups)}, "
                             f"the optimizer has {len(self.param_groups)})")
        for index, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if not isinstance(saved, dict) or not isinstance(saved.get("params"), (list, tuple)):
                raise ValueError(f"{where}: param_groups[{index}] must be a dict with a 'params' list")
            if len(saved["params"]) != len(group["params"]):
                raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                                 f"optimizer's group (param_groups[{index}]: {len(saved['params'])} saved, "
                                 f"{len(group['params'])} here)")
            self._check_options(f"{where}: param_groups[{index}]", {**self.defaults, **saved}, read_tensor_lr=True)
        id_map = dict(zip(itertools.chain.from_iterable(g["params"] for g in saved_groups),
                          itertools.chain.from_iterable(g["params"] for g in self.param_groups)))
        for key, entry in state_dict["state"].items():
            if key not in id_map:
                raise ValueError(f"{where}: state has an entry for {key!r}, which is none of the parameter ids "
                                 f"the param_groups list ({sorted(id_map, key=repr)[:8]}...)")
            param = id_map[key]
            if not isinstance(entry, dict):
                raise ValueError(f"{where}: state[{key!r}] must be a dict, got {type(entry).__name__}")
            if "step" in entry:
                step = entry["step"]
                ok = (isinstance(step, torch.Tensor) and step.numel() == 1) or (
                    isinstance(step, (int, float)) and not isinstance(step, bool))
                value = float(step) if ok else None
                if not ok or not (0.0 <= value < float("inf")):
                    raise ValueError(f"{where}: state[{key!r}]['step'] must be one finite number >= 0, got {step!r}")
            for name in self._fp32_state_keys:
                tensor = entry.get(name)
                if tensor is None:
                    continue
                if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                    raise ValueError(f"{where}: state[{key!r}][{name!r}] must be a floating tensor, got "
                                     f"{type(tensor).__name__}")
                if tensor.shape != param.shape:
                    raise ValueError(f"{where}: state[{key!r}][{name!r}] has shape {tuple(tensor.shape)} but its "
                                     f"parameter has shape {tuple(param.shape)}; the state belongs to another model")
        return id_map

    def _adapt_loaded_state(self, param: torch.Tensor, saved: dict) -> None:
        state = self.state[param]
        if "step" in state:
            state["step"] = torch.as_tensor(state["step"], dtype=torch.float32).to(param.device).reshape(())
        if param.dtype in _HALF_DTYPES:
            for key in self._fp32_state_keys:
                if saved.get(key) is not None:
                    state[key] = saved[key].to(device=param.device, dtype=torch.float32, copy=True)

    def _check_group(self, index: int, group: dict) -> None:
        """Raises ValueError naming the group when its options or gradients cannot be stepped (before any state
        exists or any group steps)."""
        name = type(self).__name__
        self._check_options(f"{name}: param_groups[{index}]", group, read_tensor_lr=False)
        devices = set()
        for param in group["params"]:
            if param.grad is None:
                continue
            if param.grad.is_sparse:
                raise ValueError(f"{name}: param_groups[{index}] has a sparse gradient; "
                                 "use a dense one (e.g. nn.Embedding(sparse=False))")
            contiguous = param.is_contiguous() and param.grad.is_contiguous()  # the common case, checked in C++
            if not contiguous and (not _is_non_overlapping_and_dense(param) or param.grad.stride() != param.stride()):
                raise ValueError(f"{name}: param_groups[{index}] has a parameter of strides {param.stride()} with a "
                                 f"gradient of strides {param.grad.stride()}; accepted: dense, non-overlapping "
                                 "parameters (contiguous, channels_last, transposed) with gradients laid out alike")
            if param.dtype not in (torch.float32, *_HALF_DTYPES) or param.grad.dtype != param.dtype:
                raise ValueError(f"{name}: param_groups[{index}] has a {param.dtype} parameter with a "
                                 f"{param.grad.dtype} gradient; accepted: float32, float16 or bfloat16 parameters "
                                 "with gradients of their dtype")
            devices.add(param.device)
        if len(devices) > 1:
            raise ValueError(f"{name}: param_groups[{index}] has parameters on several devices "
                             f"({sorted(str(d) for d in devices)}); give each device's parameters their own optimizer")
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and devices and lr.device not in devices:
            raise ValueError(f"{name}: param_groups[{index}] has its lr tensor on {lr.device} but its parameters on "
                             f"{next(iter(devices))}; put the lr tensor on the parameters' device")

    def _lists_by_kind(self, group: dict) -> dict:
        """{(device, half): [params, grads, *state lists]} for the parameters of a group that have a gradient;
        half is the dtype of float16/bfloat16 parameters, which step on an fp32 master copy (else None)."""
        lists: Dict[tuple, list] = {}
        seen = set()  # a parameter listed twice in a group (torch warns) is stepped once
        for param in group["params"]:
            if param.grad is None or id(param) in seen:
                continue
            seen.add(id(param))
            values = [param, param.grad, *self._state_tensors(param, group)]
            half = param.dtype if param.dtype in _HALF_DTYPES else None  # one launch per 16-bit dtype
            entry = lists.setdefault((param.device, half), [[] for _ in values])
            for target, value in zip(entry, values):
                target.append(value)
        return lists

    def _sync_master(self, param: torch.Tensor, state: dict) -> None:
        """Makes state["master_param"], the fp32 copy a 16-bit parameter steps on, and re-seeds it from the
        parameter when something else wrote the parameter since the last step (load_state_dict, an EMA swap,
        an in-place edit: its _version moved; our own step does not move it) and the master no longer rounds
        to it. Stepping a stale master would silently undo that write. The check reads values (a host sync
        on a GPU) only after such a write."""
        versions = self.__dict__.setdefault("_master_versions", {})
        master = state.get("master_param")
        if master is None or (versions.get(param) != param._version
                              and not torch.equal(master.to(param.dtype), param)):
            state["master_param"] = param.detach().float()
        versions[param] = param._version

    def _step_state(self, param: torch.Tensor, start: float = 0.0) -> dict:
        state = self.state[param]
        if "step" not in state:
            # torch's layout: a float32 scalar; on the parameter's device, like torch's capturable/fused steps.
            state["step"] = torch.full((), start, dtype=torch.float32, device=param.device)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Every group is checked before any state is made or any group stepped: a bad group changes nothing.
        group_of: Dict[int, int] = {}
        for index, group in enumerate(self.param_groups):
            self._check_group(index, group)
            for param in group["params"]:  # add_param_group refuses this; a hand-edited group may not
                if group_of.setdefault(id(param), index) != index:
                    raise ValueError(f"{type(self).__name__}: some parameters appear in more than one parameter "
                                     f"group (param_groups[{group_of[id(param)]}] and [{index}]); each would be "
                                     "stepped twice")
        for group in self.param_groups:
            for (device, half), lists in self._lists_by_kind(group).items():
                self._fused_step(group, lists, half is not None, *self._amp_inputs(device))
        return loss


class Adam(_FusedOptimizer):
    """Adam with L2 weight decay (``weight_decay * param`` added to the gradient), fused."""

    _decoupled = False

    def __init__(self, params: Iterable, lr: _Lr = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *, maximize: bool = False):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
        self._check_options(type(self).__name__, defaults, read_tensor_lr=True)
        super().__init__(params, defaults)

    @staticmethod
    def _check_options(where: str, options: dict, read_tensor_lr: bool) -> None:
        """gpuops::optim::check_adam_options, the C++ AdamW's rules: torch's ranges and messages, plus
        finiteness."""
        _C.check_adam_options(where, _host_lr(where, options["lr"], read_tensor_lr), options["betas"],
                              options["eps"], options["weight_decay"])

    _fp32_state_keys = ("master_param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")

    def _state_tensors(self, param: torch.Tensor, group: dict) -> list:
        state = self._step_state(param)
        master = param.dtype in _HALF_DTYPES
        if master:
            self._sync_master(param, state)
        like = state["master_param"] if master else param
        for name in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ()):
            if name not in state:
                state[name] = torch.zeros_like(like, memory_format=torch.preserve_format)
            elif master and state[name].dtype != torch.float32:  # e.g. loaded from torch's bf16 AdamW
                state[name] = state[name].float()
        tensors = [state["exp_avg"], state["exp_avg_sq"], state.get("max_exp_avg_sq", state["exp_avg_sq"]),
                   state["step"]]
        return [state["master_param"], *tensors] if master else tensors

    def _fused_step(self, group, lists, master, grad_scale, found_inf):
        beta1, beta2 = group["betas"]
        lr, lr_tensor = _lr_arguments(group)
        options = (lr, beta1, beta2, group["eps"], group["weight_decay"], self._decoupled, group["amsgrad"],
                   group["maximize"], grad_scale, found_inf, lr_tensor)
        if master:
            params, grads, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = lists
            torch.ops.gpuops.adam_step_master_(params, grads, masters, exp_avgs, exp_avg_sqs,
                                               max_exp_avg_sqs if group["amsgrad"] else [], steps, *options)
        else:
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = lists
            torch.ops.gpuops.adam_step_(params, grads, exp_avgs, exp_avg_sqs,
                                        max_exp_avg_sqs if group["amsgrad"] else [], steps, *options)


class AdamW(Adam):
    """AdamW (decoupled weight decay, default 1e-2 as torch's), fused."""

    _decoupled = True

    def __init__(self, params: Iterable, lr: _Lr = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize)


class SGD(_FusedOptimizer):
    """SGD with momentum, dampening, Nesterov and weight decay, fused. State: torch's ``momentum_buffer``
    plus a ``step`` counter (the buffer starts from the first applied step's gradient)."""

    def __init__(self, params: Iterable, lr: _Lr = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        maximize=maximize)
        self._check_options(type(self).__name__, defaults, read_tensor_lr=True)
        super().__init__(params, defaults)

    @staticmethod
    def _check_options(where: str, options: dict, read_tensor_lr: bool) -> None:
        """gpuops::optim::check_sgd_options, the C++ SGD's rules: torch's ranges and messages, plus finiteness
        and dampening in [0, 1]."""
        _C.check_sgd_options(where, _host_lr(where, options["lr"], read_tensor_lr), options["momentum"],
                             options["dampening"], options["weight_decay"], options["nesterov"])

    _fp32_state_keys = ("master_param", "momentum_buffer")

    def _state_tensors(self, param: torch.Tensor, group: dict) -> list:
        # A momentum buffer loaded from torch's SGD (which keeps no step) is continued, not restarted.
        state = self._step_state(param, start=1.0 if self.state[param].get("momentum_buffer") is not None else 0.0)
        master = param.dtype in _HALF_DTYPES
        if master:
            self._sync_master(param, state)
        like = state["master_param"] if master else param
        if group["momentum"] != 0 and state.get("momentum_buffer") is None:
            state["momentum_buffer"] = torch.zeros_like(like, memory_format=torch.preserve_format)
            state["step"].zero_()  # a new buffer starts from the next gradient, as in torch
        tensors = [state.get("momentum_buffer", like), state["step"]]
        return [state["master_param"], *tensors] if master else tensors

    def _fused_step(self, group, lists, master, grad_scale, found_inf):
        lr, lr_tensor = _lr_arguments(group)
        options = (lr, group["momentum"], group["dampening"], group["weight_decay"], group["nesterov"],
                   group["maximize"], grad_scale, found_inf, lr_tensor)
        if master:
            params, grads, masters, buffers, steps = lists
            torch.ops.gpuops.sgd_step_master_(params, grads, masters, buffers if group["momentum"] != 0 else [],
                                              steps, *options)
        else:
            params, grads, buffers, steps = lists
            torch.ops.gpuops.sgd_step_(params, grads, buffers if group["momentum"] != 0 else [], steps, *options)
