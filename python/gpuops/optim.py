"""Fused optimizers: torch.optim-compatible classes over gpuops's fused kernels.

``gpuops.optim.AdamW``, ``Adam`` and ``SGD`` have torch's constructors (every keyword of torch's signature:
``foreach``, ``fused`` and ``capturable`` are accepted and kept, since our one fused, capturable step serves
them all; ``differentiable=True`` is refused; ``Adam(decoupled_weight_decay=True)`` is AdamW), ``param_groups``
with per-group options, ``zero_grad``, ``state_dict`` keys (``step``, ``exp_avg``, ``exp_avg_sq``,
``max_exp_avg_sq``) and work with torch's LR schedulers. ``lr`` may be a one-element float32 tensor: the step
then reads it on the device, so a step captured in a CUDA graph follows the scheduler. float64 parameters step
on torch's own fused kernels (ours compute in float32), complex ones as their real views, as torch's do. They step
float16/bfloat16 parameters on an fp32 master copy (state ``master_param``, with fp32 moments / momentum)
and round the result into the parameter. One fused launch per parameter group and device. They declare
``_step_supports_amp_scaling``: a GradScaler (torch's or ours) hands them its scale and overflow flag,
and the step divides the gradients as it reads them and skips itself on overflow, on the device, with no
host sync. ``Adam``/``AdamW(state_bits=8)`` keep the moments of parameters of 4096 elements or more in block-wise
8-bit codes (``exp_avg_codes``, ``exp_avg_scales``, ...; ``dequantized_state_dict()`` gives torch's form).
"""

from __future__ import annotations

import itertools
from typing import Dict, Iterable, Optional, Tuple, Union

import torch
from torch.optim.sgd import sgd as _torch_sgd  # the functional step torch's SGD runs on sparse gradients

from . import _C  # also loads libgpuops, which registers torch.ops.gpuops


_HALF_DTYPES = (torch.float16, torch.bfloat16)
# What the optimizers step: our kernels take float32 and 16-bit parameters; float64 ones go through torch's own
# fused kernels (torch._fused_adam_ / _fused_sgd_, on our state layout), as torch's optimizers take them; complex
# parameters step as their real views (torch.view_as_real), as torch steps them.
_STEPPED_DTYPES = (torch.float32, *_HALF_DTYPES, torch.float64, torch.complex64, torch.complex128)
_Lr = Union[float, torch.Tensor]


def _real_dtype(t: torch.Tensor) -> torch.dtype:
    return t.real.dtype if t.is_complex() else t.dtype


def _check_impl_flags(where: str, options: dict) -> None:
    """torch's implementation flags (foreach, fused, capturable, differentiable): torch's refusals with torch's
    error types and messages, then the one value we cannot honour. foreach and fused only choose among torch's
    implementations; ours has one (fused, and capturable: the state and a tensor lr stay on the device), so
    every value of theirs steps alike and is kept in param_groups as given."""
    foreach, fused = options.get("foreach"), options.get("fused")
    for name, value in (("foreach", foreach), ("fused", fused)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{where}: {name} must be None, True or False, got {value!r}")
    if "capturable" in options and isinstance(options["lr"], torch.Tensor) and foreach and not options["capturable"]:
        raise ValueError(f"{where}: lr as a Tensor is not supported for capturable=False and foreach=True")
    if fused and options.get("differentiable"):
        raise RuntimeError(f"{where}: `fused` does not support `differentiable`")
    if fused and foreach:
        raise RuntimeError(f"{where}: `fused` and `foreach` cannot be `True` together.")
    if options.get("differentiable"):
        raise ValueError(f"{where}: differentiable={options['differentiable']!r} is not supported: our fused step is "
                         "not differentiable (torch's optimizers with differentiable=True are)")


def _host_betas(group: dict) -> tuple:
    """The betas as numbers (a tensor beta, which torch accepts, is read on the host at each step)."""
    return tuple(float(b) if isinstance(b, torch.Tensor) else b for b in group["betas"])


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


def _stepped_pair(param: torch.Tensor) -> tuple:
    """The parameter and gradient the fused step reads linearly: themselves in the common case. A parameter that
    is not one dense block (a strided view, which torch steps) is stepped as a contiguous copy and written back
    after the step; a gradient laid out otherwise than what is stepped is copied into that layout. Its state is
    laid out as that copy, as zeros_like(param) lays it out (loaded state too: _lay_out_state_like)."""
    grad = param.grad
    if param.is_contiguous() and grad.is_contiguous():
        return param, grad
    # empty_like lays the copy out as zeros_like(param) lays out its state (dense, in the parameter's order)
    stepped = param if _is_non_overlapping_and_dense(param) else torch.empty_like(param).copy_(param.detach())
    if grad.stride() != stepped.stride() or not _is_non_overlapping_and_dense(grad):
        grad = torch.empty_like(stepped).copy_(grad)
    return stepped, grad


def _lay_out_state_like(state: dict, param: torch.Tensor) -> None:
    """Loaded state tensors of the parameter's shape laid out otherwise than the state we create for it
    (zeros_like(param): torch's SGD momentum buffer takes its first gradient's layout instead) are copied into
    that layout: the fused step reads them linearly beside what it steps."""
    like = torch.empty_like(param, device="meta")
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.shape == param.shape and value.stride() != like.stride():
            state[key] = torch.empty_like(param, dtype=value.dtype, device=value.device).copy_(value)


# 8-bit moments (state_bits=8): per parameter, uint8 codes laid out as the parameter and one float32 scale per
# block of STATE_BLOCK elements in memory order; "state_format" names the code books (gpuops/fused_adam8.h).
MIN_8BIT_NUMEL = _C.MIN_8BIT_NUMEL  # smaller parameters keep float32 moments, as in bitsandbytes
_CODE_KEYS = ("exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales")
_MOMENTS = (("exp_avg", True), ("exp_avg_sq", False))  # (name, signed code book)


def _quantize_moments(state: dict, like: torch.Tensor) -> None:
    """Gives the state 8-bit moments laid out as ``like``: encoded from its float32 ones when it has them (a
    loaded torch AdamW state, or a group switched to state_bits=8), else zeros."""
    if "exp_avg_codes" in state:
        return
    blocks = -(-like.numel() // _C.STATE_BLOCK)
    for name, signed in _MOMENTS:
        codes = torch.empty_like(like, dtype=torch.uint8, memory_format=torch.preserve_format)
        scales = torch.empty(blocks, dtype=torch.float32, device=like.device)
        values = state.get(name)
        if values is None:
            values = torch.zeros_like(like, memory_format=torch.preserve_format)
        elif values.stride() != like.stride() or values.dtype != torch.float32:
            values = torch.empty_like(like, memory_format=torch.preserve_format).copy_(values)
        torch.ops.gpuops.quantize_state_(values, codes, scales, signed)
        state[f"{name}_codes"], state[f"{name}_scales"] = codes, scales
    for name, _ in _MOMENTS:
        state.pop(name, None)
    state["state_format"] = _C.STATE_FORMAT


def _dequantize_moments(state: dict) -> None:
    """Float32 moments again in place of 8-bit ones (state_bits=32 now, or the parameter no longer qualifies)."""
    if "exp_avg_codes" not in state:
        return
    for name, signed in _MOMENTS:
        state[name] = torch.ops.gpuops.dequantize_state(state.pop(f"{name}_codes"), state.pop(f"{name}_scales"),
                                                        signed)
    state.pop("state_format", None)


def _decoded_entry(entry: dict) -> dict:
    """A state_dict entry with float32 moments in place of 8-bit ones (a copy; the optimizer's own unchanged)."""
    decoded = dict(entry)
    _dequantize_moments(decoded)
    return decoded


def _check_8bit_entry(where: str, entry: dict, param: torch.Tensor) -> None:
    """Raises ValueError naming what is wrong with an 8-bit state entry (before anything is loaded)."""
    missing = [k for k in _CODE_KEYS if k not in entry]
    if missing:
        raise ValueError(f"{where}: an 8-bit state needs {', '.join(_CODE_KEYS)}; {', '.join(missing)} missing")
    if entry.get("state_format") != _C.STATE_FORMAT:
        raise ValueError(f"{where}: state_format is {entry.get('state_format')!r}; this version reads "
                         f"{_C.STATE_FORMAT!r} (other code books would decode to wrong values)")
    blocks = -(-param.numel() // _C.STATE_BLOCK)
    for name, _ in _MOMENTS:
        codes, scales = entry[f"{name}_codes"], entry[f"{name}_scales"]
        if not isinstance(codes, torch.Tensor) or codes.shape != param.shape or codes.dtype != torch.uint8:
            raise ValueError(f"{where}[{name + '_codes'!r}] must be a uint8 tensor of the parameter's shape "
                             f"{tuple(param.shape)}, got {_describe(codes)}")
        if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or scales.shape != (blocks,):
            raise ValueError(f"{where}[{name + '_scales'!r}] must be a float32 tensor of {blocks} elements (one per "
                             f"{_C.STATE_BLOCK}), got {_describe(scales)}")
        if bool((scales < 0).any()):
            raise ValueError(f"{where}[{name + '_scales'!r}] has negative scales (a scale is its block's largest "
                             "magnitude, >= 0): not a state this optimizer wrote")


def _describe(value) -> str:
    return f"{value.dtype} of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def _load_moments(state: dict, saved: dict, param: torch.Tensor) -> None:
    """The saved 8-bit moments on the parameter's device (torch's load cast them to its dtype: taken from the
    saved entry again). Codes laid out otherwise than the state we make are decoded, to be encoded in our layout
    at the next step: blocks run over memory order, so an element-wise copy would mix blocks."""
    like = state.get("master_param", param)
    moved = {key: saved[key].to(param.device, dtype=torch.uint8 if key.endswith("codes") else torch.float32,
                                copy=True) for key in _CODE_KEYS}
    state.update(moved)
    state["state_format"] = saved["state_format"]  # (torch's load turned the string into a generator's repr)
    ours = torch.empty_like(like, device="meta").stride()
    if moved["exp_avg_codes"].stride() != ours or moved["exp_avg_sq_codes"].stride() != ours:
        _dequantize_moments(state)


def _lr_arguments(group: dict, device: torch.device) -> tuple:
    """(host lr, lr tensor on `device` or None) for the fused ops; a tensor lr replaces the host one. A tensor lr
    elsewhere (torch's tests give CUDA parameters a CPU one) is copied to the parameters' device at each step."""
    lr = group["lr"]
    return (0.0, lr.to(device, non_blocking=True).reshape(1)) if isinstance(lr, torch.Tensor) else (float(lr), None)


def _wide_lr(group: dict, device: torch.device):
    """The lr for torch's fused kernels: a float, or a tensor on the parameters' device."""
    lr, lr_tensor = _lr_arguments(group, device)
    return lr if lr_tensor is None else lr_tensor


class _FusedOptimizer(torch.optim.Optimizer):
    """What the fused optimizers share: the AMP hand-off and the per-device tensor lists of a group."""

    _steps_sparse = False  # SGD steps sparse gradients (torch's own single-tensor step), as torch's SGD does

    _fp32_state_keys: Tuple[str, ...] = ()  # state kept in float32 for 16-bit parameters
    # A class attribute, so that copies (deepcopy, pickle) keep the sync-free hand-off to GradScaler.
    _step_supports_amp_scaling = True

    def __init__(self, params: Iterable, defaults: dict):
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
        parameter of a group, ``step`` one number in [0, 2**53], its tensors floating with the parameter's shape),
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

    def _checked_id_map(self, state_dict, where: Optional[str] = None) -> dict:
        """Checks everything load_state_dict will use; returns {saved parameter id: parameter}. gpuops.ZeroOptimizer
        applies these checks too (``where`` names it then)."""
        where = where or f"{type(self).__name__}.load_state_dict"
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
                if not ok or not (0.0 <= value <= 2.0**53):  # beyond, not a count of steps (float64's integers)
                    raise ValueError(f"{where}: state[{key!r}]['step'] must be one number in [0, 2**53], got "
                                     f"{step!r}")
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
        _lay_out_state_like(state, param)
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
            if param.grad.is_sparse and not self._steps_sparse:
                raise ValueError(f"{name}: param_groups[{index}] has a sparse gradient; "
                                 "use a dense one (e.g. nn.Embedding(sparse=False)), or SGD, which steps it")
            if param.grad.is_sparse and group["weight_decay"] != 0:  # torch's SGD fails on it mid-step
                raise ValueError(f"{name}: param_groups[{index}] has a sparse gradient and weight_decay "
                                 f"{group['weight_decay']}; accepted: weight_decay 0 for sparse gradients (torch's "
                                 "SGD cannot add a dense weight to a sparse gradient either)")
            if param.grad.layout != torch.strided and not param.grad.is_sparse:
                raise ValueError(f"{name}: param_groups[{index}] has a gradient of layout {param.grad.layout}; "
                                 "accepted: strided (dense) gradients" + (", or sparse COO ones" if
                                                                          self._steps_sparse else ""))
            if param.grad.shape != param.shape:
                raise ValueError(f"{name}: param_groups[{index}] has a parameter of shape {tuple(param.shape)} with a "
                                 f"gradient of shape {tuple(param.grad.shape)}")
            if param.dtype not in _STEPPED_DTYPES or param.grad.dtype != param.dtype:
                raise ValueError(f"{name}: param_groups[{index}] has a {param.dtype} parameter with a "
                                 f"{param.grad.dtype} gradient; accepted: float32, float16, bfloat16, float64, "
                                 "complex64 or complex128 parameters with gradients of their dtype")
            devices.add(param.device)
        if len(devices) > 1:
            raise ValueError(f"{name}: param_groups[{index}] has parameters on several devices "
                             f"({sorted(str(d) for d in devices)}); give each device's parameters their own optimizer")

    def _lists_by_kind(self, group: dict, staged: list) -> dict:
        """{(device, dtype, state bits): [params, grads, *state lists]} for the parameters of a group that have a
        dense gradient; dtype is the real dtype (complex tensors are listed as their real views); float16/bfloat16
        parameters step on an fp32 master copy. A parameter stepped as a dense copy is added to ``staged`` as
        (parameter, copy), to be written back."""
        lists: Dict[tuple, list] = {}
        seen = set()  # a parameter listed twice in a group (torch warns) is stepped once
        for param in group["params"]:
            if param.grad is None or param.grad.is_sparse or id(param) in seen:
                continue
            seen.add(id(param))
            stepped, grad = _stepped_pair(param)
            if stepped is not param:
                staged.append((param, stepped))
            values = [stepped, grad, *self._state_tensors(param, group)]
            if param.is_complex():  # torch steps a complex parameter (and its state) as its real view
                values = [torch.view_as_real(v) if isinstance(v, torch.Tensor) and v.is_complex() else v
                          for v in values]
            key = (param.device, _real_dtype(param), self._state_bits_for(param, group))
            entry = lists.setdefault(key, [[] for _ in values])
            for target, value in zip(entry, values):
                target.append(value)
        return lists

    def _state_bits_for(self, param: torch.Tensor, group: dict) -> int:
        """32: float32 states (Adam's 8-bit option overrides this)."""
        return 32

    def _sync_master(self, param: torch.Tensor, state: dict) -> None:
        """Makes state["master_param"], the fp32 copy a 16-bit parameter steps on, and re-seeds it from the
        parameter when something else wrote the parameter since the last step (load_state_dict, an EMA swap,
        an in-place edit: its _version moved since our own step recorded it) and the master no longer rounds
        to it. Stepping a stale master would silently undo that write. The check reads values (a host sync
        on a GPU) only after such a write."""
        versions = self.__dict__.setdefault("_master_versions", {})
        master = state.get("master_param")
        if master is None or (versions.get(param) != param._version
                              and not torch.equal(master.to(param.dtype), param)):
            state["master_param"] = param.detach().float()
        versions[param] = param._version

    def _note_own_writes(self, params: list) -> None:
        """Our step writes the 16-bit parameters and bumps their versions (as torch's in-place ops do): record
        the versions after it, so that the next _sync_master sees no foreign write and reads nothing."""
        versions = self.__dict__.setdefault("_master_versions", {})
        for param in params:
            versions[param] = param._version

    def _step_state(self, param: torch.Tensor, start: float = 0.0) -> dict:
        state = self.state[param]
        if "step" not in state:
            # torch's layout: a float32 scalar; on the parameter's device, like torch's capturable/fused steps.
            state["step"] = torch.full((), start, dtype=torch.float32, device=param.device)
        return state

    # Under torch.compile the step runs eagerly, one graph break (as our GradScaler's methods): it is already one
    # fused launch per group, and its host-side checks (gpuops._C) and lazily made state are not traceable.
    @torch.compiler.disable
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
            staged: list = []
            try:
                for (device, dtype, bits), lists in self._lists_by_kind(group, staged).items():
                    if dtype == torch.float64:
                        self._wide_step(group, lists, *self._amp_inputs(device))
                    elif bits == 8:
                        self._fused_step8(group, lists, dtype in _HALF_DTYPES, *self._amp_inputs(device))
                    else:
                        self._fused_step(group, lists, dtype in _HALF_DTYPES, *self._amp_inputs(device))
            finally:  # what was stepped reaches its parameter, whatever failed after it
                self._write_back(staged)
            if self._steps_sparse:
                self._sparse_step(group)
        return loss

    def _write_back(self, staged: list) -> None:
        """The dense copies stepped for strided parameters, copied into them (their 16-bit versions recorded as
        our own write, the copies forgotten)."""
        versions = self.__dict__.setdefault("_master_versions", {})
        for param, stepped in staged:
            param.copy_(stepped)
            versions.pop(stepped, None)
        self._note_own_writes([param for param, _ in staged if param.dtype in _HALF_DTYPES])


class Adam(_FusedOptimizer):
    """Adam with L2 weight decay (``weight_decay * param`` added to the gradient), fused. ``state_bits``: 32
    (float32 moments, torch's layout) or 8 (block-wise 8-bit moments for parameters of MIN_8BIT_NUMEL elements
    or more; a group option)."""

    _decoupled = False  # AdamW: always; Adam: with decoupled_weight_decay=True, as torch's

    def __init__(self, params: Iterable, lr: _Lr = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0, amsgrad: bool = False, *,
                 foreach: Optional[bool] = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None, decoupled_weight_decay: bool = False,
                 state_bits: int = 32):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay, state_bits=state_bits)
        self._check_options(type(self).__name__, defaults, read_tensor_lr=True)
        # torch keeps a tensor beta as a 0-dim tensor
        defaults["betas"] = tuple(b.reshape(()) if isinstance(b, torch.Tensor) else b for b in betas)
        super().__init__(params, defaults)

    @staticmethod
    def _check_options(where: str, options: dict, read_tensor_lr: bool) -> None:
        """torch's flag and betas checks, then gpuops::optim::check_adam_options, the C++ AdamW's rules: torch's
        ranges and messages, plus finiteness."""
        _check_impl_flags(where, options)
        betas = options["betas"]
        if isinstance(betas, (tuple, list)) and len(betas) == 2:
            is_tensor = [isinstance(b, torch.Tensor) for b in betas]
            if is_tensor[0] != is_tensor[1]:
                raise ValueError(f"{where}: betas must be either both floats or both Tensors, got {tuple(betas)!r}")
            for index, beta in enumerate(betas):
                if not is_tensor[index]:
                    continue
                if options.get("foreach") and not options.get("capturable"):
                    raise ValueError(f"{where}: betas[{index}] as a Tensor is not supported for capturable=False and "
                                     "foreach=True")
                if beta.numel() != 1:
                    raise ValueError(f"{where}: Tensor betas[{index}] must be 1-element, got {beta.numel()} elements")
        _C.check_adam_options(where, _host_lr(where, options["lr"], read_tensor_lr), options["betas"],
                              options["eps"], options["weight_decay"])
        bits = options.get("state_bits", 32)
        if isinstance(bits, bool) or bits not in (8, 32):
            raise ValueError(f"{where}: state_bits must be 32 (float32 moments) or 8 (block-wise 8-bit moments), "
                             f"got {bits!r}")
        if bits == 8 and options["amsgrad"]:
            raise ValueError(f"{where}: amsgrad=True is not supported with state_bits=8 (its running maximum would "
                             "be a third state); use state_bits=32 for amsgrad")

    _fp32_state_keys = ("master_param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")

    def _state_bits_for(self, param: torch.Tensor, group: dict) -> int:
        """8 for a float32/16-bit parameter of at least MIN_8BIT_NUMEL elements in a state_bits=8 group."""
        eligible = param.dtype in (torch.float32, *_HALF_DTYPES) and param.numel() >= MIN_8BIT_NUMEL
        return 8 if group.get("state_bits", 32) == 8 and eligible else 32

    def _state_tensors(self, param: torch.Tensor, group: dict) -> list:
        state = self._step_state(param)
        master = param.dtype in _HALF_DTYPES
        if master:
            self._sync_master(param, state)
        like = state["master_param"] if master else param
        if self._state_bits_for(param, group) == 8:
            _quantize_moments(state, like)
            tensors = [state[k] for k in _CODE_KEYS] + [state["step"]]
            return [state["master_param"], *tensors] if master else tensors
        _dequantize_moments(state)  # (a state_bits=8 group set back to 32, or an 8-bit state loaded into one)
        for name in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ()):
            if name not in state:
                state[name] = torch.zeros_like(like, memory_format=torch.preserve_format)
            elif master and state[name].dtype != torch.float32:  # e.g. loaded from torch's bf16 AdamW
                state[name] = state[name].float()
        tensors = [state["exp_avg"], state["exp_avg_sq"], state.get("max_exp_avg_sq", state["exp_avg_sq"]),
                   state["step"]]
        return [state["master_param"], *tensors] if master else tensors

    def _fused_step8(self, group, lists, master, grad_scale, found_inf):
        """8-bit moments: one pass per 256-element block (decode, update, re-encode), gpuops/fused_adam8.h."""
        beta1, beta2 = _host_betas(group)
        lr, lr_tensor = _lr_arguments(group, lists[0][0].device)
        if master:
            params, grads, masters, *codes, steps = lists
        else:
            (params, grads, *codes, steps), masters = lists, []
        torch.ops.gpuops.adam8_step_(params, grads, masters, *codes, steps, lr, beta1, beta2, group["eps"],
                                     group["weight_decay"], self._decoupled_in(group), group["maximize"], grad_scale,
                                     found_inf, lr_tensor)
        if master:
            self._note_own_writes(params)

    def _checked_id_map(self, state_dict, where: Optional[str] = None) -> dict:
        """The checks of every fused optimizer, and an 8-bit state's: all four tensors, uint8 codes of the
        parameter's shape, float32 scales one per 256 elements, and a code book this version reads."""
        id_map = super()._checked_id_map(state_dict, where)
        where = where or f"{type(self).__name__}.load_state_dict"
        for key, entry in state_dict["state"].items():
            if any(k in entry for k in _CODE_KEYS):
                _check_8bit_entry(f"{where}: state[{key!r}]", entry, id_map[key])
        return id_map

    def _adapt_loaded_state(self, param: torch.Tensor, saved: dict) -> None:
        super()._adapt_loaded_state(param, saved)
        if "exp_avg_codes" in saved:  # torch's load cast codes and scales to the parameter's dtype: taken again
            _load_moments(self.state[param], saved, param)

    def dequantized_state_dict(self) -> dict:
        """state_dict() in torch's form: 8-bit moments decoded into float32 ``exp_avg`` / ``exp_avg_sq``, which
        torch.optim.AdamW (and this class with state_bits=32) loads. The optimizer itself is unchanged."""
        saved = self.state_dict()
        saved["state"] = {key: _decoded_entry(entry) for key, entry in saved["state"].items()}
        return saved

    def _decoupled_in(self, group: dict) -> bool:
        return self._decoupled or bool(group.get("decoupled_weight_decay", False))

    def _wide_step(self, group, lists, grad_scale, found_inf):
        """float64 parameters: torch's own fused Adam kernel on our state (float32 step counters on the device),
        with torch's AMP hand-off (it divides by grad_scale and skips on found_inf, on the device)."""
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = lists
        beta1, beta2 = _host_betas(group)
        torch._foreach_add_(steps, 1)
        kernel = torch._fused_adamw_ if self._decoupled_in(group) else torch._fused_adam_
        kernel(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if group["amsgrad"] else [], steps,
               amsgrad=group["amsgrad"], lr=_wide_lr(group, params[0].device), beta1=beta1, beta2=beta2,
               weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
               grad_scale=grad_scale, found_inf=found_inf)
        if found_inf is not None:  # a skipped step does not count, as in torch's fused Adam
            torch._foreach_sub_(steps, [found_inf] * len(steps))

    def _fused_step(self, group, lists, master, grad_scale, found_inf):
        beta1, beta2 = _host_betas(group)
        lr, lr_tensor = _lr_arguments(group, lists[0][0].device)
        options = (lr, beta1, beta2, group["eps"], group["weight_decay"], self._decoupled_in(group), group["amsgrad"],
                   group["maximize"], grad_scale, found_inf, lr_tensor)
        if master:
            params, grads, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = lists
            torch.ops.gpuops.adam_step_master_(params, grads, masters, exp_avgs, exp_avg_sqs,
                                               max_exp_avg_sqs if group["amsgrad"] else [], steps, *options)
            self._note_own_writes(params)
        else:
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = lists
            torch.ops.gpuops.adam_step_(params, grads, exp_avgs, exp_avg_sqs,
                                        max_exp_avg_sqs if group["amsgrad"] else [], steps, *options)


class AdamW(Adam):
    """AdamW (decoupled weight decay, default 1e-2 as torch's), fused."""

    _decoupled = True

    def __init__(self, params: Iterable, lr: _Lr = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, state_bits: int = 32):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, state_bits=state_bits)


class SGD(_FusedOptimizer):
    """SGD with momentum, dampening, Nesterov and weight decay, fused; sparse gradients step as in torch's SGD.
    State: torch's ``momentum_buffer`` plus a ``step`` counter (the buffer starts from the first applied step's
    gradient); ``state_dict()`` is torch's SGD's (the buffer only), so that it cross-loads both ways."""

    def __init__(self, params: Iterable, lr: _Lr = 1e-3, momentum: float = 0, dampening: float = 0,
                 weight_decay: float = 0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, differentiable: bool = False, fused: Optional[bool] = None):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        maximize=maximize, foreach=foreach, differentiable=differentiable, fused=fused)
        self._check_options(type(self).__name__, defaults, read_tensor_lr=True)
        super().__init__(params, defaults)
        self.register_state_dict_post_hook(SGD._as_torch_state, prepend=True)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)  # torch's pickling drops hooks: a copy (deepcopy, pickle) gets ours back
        if SGD._as_torch_state not in self._optimizer_state_dict_post_hooks.values():
            self.register_state_dict_post_hook(SGD._as_torch_state, prepend=True)

    @staticmethod
    def _check_options(where: str, options: dict, read_tensor_lr: bool) -> None:
        """gpuops::optim::check_sgd_options, the C++ SGD's rules: torch's ranges and messages, plus finiteness
        and dampening in [0, 1]."""
        _check_impl_flags(where, options)
        _C.check_sgd_options(where, _host_lr(where, options["lr"], read_tensor_lr), options["momentum"],
                             options["dampening"], options["weight_decay"], options["nesterov"])

    _fp32_state_keys = ("master_param", "momentum_buffer")
    _steps_sparse = True

    def _sparse_step(self, group: dict) -> None:
        """Parameters with sparse gradients (nn.Embedding(sparse=True)): torch's own single-tensor SGD on the
        same momentum_buffer state, as torch's SGD steps them. Under a GradScaler's hand-off the gradients are
        divided by the scale and the step is skipped on overflow, which reads the flag on the host (a sync, as
        torch's scaler makes for any optimizer without the device hand-off); dense parameters never wait for it."""
        params = [p for p in group["params"] if p.grad is not None and p.grad.is_sparse]
        if not params:
            return
        grad_scale, found_inf = self._amp_inputs(params[0].device)
        if found_inf is not None and bool(found_inf.item()):
            return
        grads = [p.grad if grad_scale is None else p.grad / grad_scale.reshape(()) for p in params]
        buffers = [self.state[p].get("momentum_buffer") if group["momentum"] != 0 else None for p in params]
        lr = group["lr"]
        _torch_sgd(params, grads, buffers, has_sparse_grad=True, foreach=False, fused=False,
                            weight_decay=group["weight_decay"], momentum=group["momentum"],
                            lr=float(lr) if isinstance(lr, torch.Tensor) else lr, dampening=group["dampening"],
                            nesterov=group["nesterov"], maximize=group["maximize"])
        if group["momentum"] != 0:
            for param, buffer in zip(params, buffers):
                self.state[param]["momentum_buffer"] = buffer

    @staticmethod
    def _as_torch_state(optimizer, state_dict: dict) -> dict:
        """state_dict post-hook: the state as torch's SGD keeps it, so that state dicts cross-load both ways and
        compare equal: a ``momentum_buffer`` once a step has applied one, and nothing else (our ``step`` counter,
        which says whether the buffer has started, is rebuilt on load: a loaded buffer continues). A 16-bit
        parameter's fp32 ``master_param`` stays."""
        state = {}
        for key, entry in state_dict["state"].items():
            step = entry.get("step")
            started = step is None or float(step) > 0  # a float64 parameter's state has no step (torch's kernel)
            kept = {k: v for k, v in entry.items() if k not in ("step", "momentum_buffer")}  # a 16-bit master
            if entry.get("momentum_buffer") is not None and started:
                kept["momentum_buffer"] = entry["momentum_buffer"]
            if kept:
                state[key] = kept
        state_dict["state"] = state
        return state_dict

    def _state_tensors(self, param: torch.Tensor, group: dict) -> list:
        if _real_dtype(param) == torch.float64:  # torch's kernel, torch's state: a momentum buffer and no step
            if group["momentum"] == 0:
                return [param, False]
            state = self.state[param]
            new = state.get("momentum_buffer") is None
            if new:  # zeros, not torch's empty_like: a step skipped on overflow leaves no garbage behind
                state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            return [state["momentum_buffer"], new]
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

    def _wide_step(self, group, lists, grad_scale, found_inf):
        """float64 parameters: torch's own fused SGD kernel, with torch's AMP hand-off; a new momentum buffer
        starts from its first gradient (is_first_step), as in torch."""
        params, grads, buffers, new = lists
        options = dict(weight_decay=group["weight_decay"], momentum=group["momentum"],
                       lr=_wide_lr(group, params[0].device), dampening=group["dampening"],
                       nesterov=group["nesterov"], maximize=group["maximize"], grad_scale=grad_scale,
                       found_inf=found_inf)
        if group["momentum"] == 0:
            torch._fused_sgd_(params, grads, [], is_first_step=False, **options)
            return
        for first in (True, False):
            chosen = [i for i, is_new in enumerate(new) if is_new == first]
            if chosen:
                torch._fused_sgd_([params[i] for i in chosen], [grads[i] for i in chosen],
                                  [buffers[i] for i in chosen], is_first_step=first, **options)

    def _fused_step(self, group, lists, master, grad_scale, found_inf):
        lr, lr_tensor = _lr_arguments(group, lists[0][0].device)
        options = (lr, group["momentum"], group["dampening"], group["weight_decay"], group["nesterov"],
                   group["maximize"], grad_scale, found_inf, lr_tensor)
        if master:
            params, grads, masters, buffers, steps = lists
            torch.ops.gpuops.sgd_step_master_(params, grads, masters, buffers if group["momentum"] != 0 else [],
                                              steps, *options)
            self._note_own_writes(params)
        else:
            params, grads, buffers, steps = lists
            torch.ops.gpuops.sgd_step_(params, grads, buffers if group["momentum"] != 0 else [], steps, *options)
