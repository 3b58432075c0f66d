"""Mixed precision: a dynamic loss scaler that drops in for ``torch.amp.GradScaler``.

Same constructor, methods and ``state_dict`` keys as torch's, so checkpoints move both ways, plus:

* ``hysteresis`` (DeepSpeed's meaning and default: overflowing steps tolerated before backing off, the
  budget restored when the scale grows; 1 is torch's behaviour), ``min_scale`` and ``max_scale``;
* unscaling accepts float32, float16 and bfloat16 gradients (torch's refuses 16-bit ones);
* ``skipped_steps`` counts the steps that an overflow skipped, on the device (no sync until read), so a
  learning-rate scheduler can stay in step with the optimizer; ``step_applied`` is the last step's flag
  as a device tensor.

The unscale + non-finite check is one multi-tensor launch per device and dtype, and the scale update
runs on the device: ``torch.ops.gpuops.unscale_and_check_`` and ``torch.ops.gpuops.update_scale_``.
"""

from __future__ import annotations

import enum
import functools
import inspect
import warnings
from collections import abc, defaultdict
from typing import Any, Dict, Iterable, Optional, Union

import torch

from . import _C  # also loads libgpuops, which registers torch.ops.gpuops


class _Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    CLIPPED = 2  # clip_grad_norm_ ran pass 1; a fused optimizer applies 1/scale and the clip factor itself
    STEPPED = 3


def _apply_to_tensors(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (str, bytes, abc.Mapping)):  # iterable, but of characters or keys: never tensors
        raise TypeError("GradScaler.scale: outputs must be a tensor or a (nested) list/tuple of tensors, got "
                        f"{type(value).__name__} {value!r:.80}")
    if isinstance(value, (list, tuple)):
        return type(value)(_apply_to_tensors(v, fn) for v in value)
    if isinstance(value, abc.Iterable):  # e.g. a generator: a lazy map, as torch's scaler returns
        return map(lambda v: _apply_to_tensors(v, fn), value)
    raise TypeError(f"GradScaler.scale: outputs must be a tensor or a (nested) list/tuple of tensors, got {type(value)}")


def _real_number(where: str, name: str, value) -> float:
    """value as a float; TypeError naming `name` for a str, None or another non-number (torch raises a bare
    comparison error), ValueError for an int beyond a double."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"{where}: {name} must be a real number or a one-element tensor, got a tensor of shape "
                            f"{tuple(value.shape)}")
        return float(value)
    if isinstance(value, (str, bytes)) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise TypeError(f"{where}: {name} must be a real number, got {value!r:.80}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{where}: Invalid {name} value: {value!r:.80} (beyond a double)") from None


def _check_optimizer(where: str, optimizer) -> None:
    if not hasattr(optimizer, "param_groups") or not callable(getattr(optimizer, "step", None)):
        raise TypeError(f"{where}: optimizer must be a torch.optim.Optimizer (param_groups and step()), got "
                        f"{type(optimizer).__name__}")


@functools.lru_cache(maxsize=256)
def _takes_grad_scaler(step) -> bool:
    """Whether an optimizer's step declares ``grad_scaler``: torch's deprecated hand-off, in which the scaler
    passes itself and the optimizer calls the scaler's private methods."""
    try:
        return "grad_scaler" in inspect.signature(step).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def _refuse_the_old_hand_off(optimizer) -> None:
    if _takes_grad_scaler(type(optimizer).step):
        raise TypeError(f"GradScaler.step: {type(optimizer).__name__}.step takes grad_scaler=, torch's deprecated "
                        "hand-off (torch warns FutureWarning), in which the optimizer calls torch.amp.GradScaler's "
                        "private methods; gpuops.GradScaler does not make it, and the step would run without the "
                        "scale. Read self.grad_scale and self.found_inf in step() (torch's current hand-off), or "
                        "use torch.amp.GradScaler with this optimizer")


def _grads_by_device(optimizer) -> Dict[torch.device, list]:
    """The dense tensors holding each device's gradients: a sparse gradient is coalesced (so that a norm over
    its values is right and fp16 duplicates cannot overflow when summed) and stands in by its values."""
    prepare = getattr(optimizer, "_gpuops_prepare_gradients", None)
    if prepare is not None:  # a sharded optimizer (gpuops.ZeroOptimizer) reduces its gradients first
        prepare()
    grads: Dict[torch.device, list] = defaultdict(list)
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is None:
                continue
            if param.grad.is_sparse:
                if not param.grad.is_coalesced():
                    param.grad = param.grad.coalesce()
                grads[param.grad.device].append(param.grad._values())
            else:
                grads[param.grad.device].append(param.grad)
    return grads


def _global_found_inf(optimizer, found_inf: torch.Tensor) -> torch.Tensor:
    """A sharded optimizer's overflow flag covers every rank (one all-reduce)."""
    combine = getattr(optimizer, "_gpuops_global_found_inf", None)
    return found_inf if combine is None else combine(found_inf)


def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill one block of memory without gaps or overlap (contiguous, transposed,
    channels_last), which the norm pass reads linearly."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _norm_readable(grads: list) -> list:
    """The gradients as the norm pass reads them: a strided view (a slice) or a float64 gradient stands in by
    a dense float32 copy (read only; unscale_and_check_ writes such gradients through torch's own kernel)."""
    native = (torch.float32, torch.float16, torch.bfloat16)

    def readable(g):
        if g.layout != torch.strided or g.device.type == "meta" or not g.is_floating_point():
            return g  # as it is: the op's own checks name what it refuses
        return g if g.dtype in native and _dense(g) else g.float().contiguous()

    return [readable(g) for g in grads]


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: Optional[bool] = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` with its signature: for the L2 norm, one deterministic read for the
    norm and one in-place scaling, always on the device, without a host sync (the factor is 1 when the norm is
    within max_norm; 0 when max_norm is 0). Other norm types are torch's. ``error_if_nonfinite`` reads the
    norm on the host, as torch's does; ``foreach`` is accepted and ignored. Returns the total norm."""
    norm = norm_type if isinstance(norm_type, str) and norm_type == "inf" else _real_number(
        "clip_grad_norm_", "norm_type", norm_type)
    if norm != norm:  # NaN: torch's would scale every gradient by NaN
        raise ValueError(f"clip_grad_norm_: norm_type must be a number or 'inf', got {norm_type!r}")
    limit = _real_number("clip_grad_norm_", "max_norm", max_norm)
    if not limit >= 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be >= 0, got {max_norm}")
    if not isinstance(max_norm, torch.Tensor):
        max_norm = limit  # (an int past float32 would overflow in the division by the norm)
    if parameters is None or isinstance(parameters, (str, bytes)):
        raise TypeError(f"clip_grad_norm_: parameters must be a tensor or an iterable of tensors, got {parameters!r:.80}")
    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    for i, p in enumerate(parameters):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"clip_grad_norm_: parameters[{i}] must be a tensor, got {type(p).__name__}")
    with_grads = [p.grad for p in parameters if p.grad is not None]
    if float(norm) != 2.0 or any(g.layout != torch.strided or g.device.type == "meta" for g in with_grads):
        # Other norms, sparse or meta gradients: torch's own clipping (our ops take dense device memory).
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    grads: Dict[torch.device, list] = defaultdict(list)
    for g in with_grads:
        grads[g.device].append(g)
    if not grads:
        return torch.zeros(())
    norms = []
    for device, device_grads in grads.items():
        ones = torch.ones(1, device=device)
        norms.append(torch.ops.gpuops.unscaled_grad_norm_(_norm_readable(device_grads), ones,
                                                          torch.zeros(1, device=device)))
    first = next(iter(grads))
    total_norm = torch.stack([n.to(first) for n in norms]).square().sum().sqrt()
    if error_if_nonfinite and not torch.isfinite(total_norm):
        raise RuntimeError(f"clip_grad_norm_: the gradients' total norm is {total_norm.item()}, which cannot clip "
                           "them; pass error_if_nonfinite=False to scale them by it anyway")
    clip_coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0).float().reshape(1)
    for device, device_grads in grads.items():
        torch.ops.gpuops.unscale_and_check_(device_grads, torch.zeros(1, device=device), clip_coef.to(device))
    return total_norm


def clip_sharded_grad_norm_(optimizer, max_norm: float) -> torch.Tensor:
    """Clips a sharded optimizer's gradients (gpuops.ZeroOptimizer's) by their global L2 norm: reduced first,
    the norm over every rank's shard, each shard clipped in place (as the C++ scaler's disabled path). Returns
    the total norm. What ZeroOptimizer.clip_grad_norm_ and a disabled GradScaler's clip_grad_norm_ run."""
    grads = _grads_by_device(optimizer)  # reduces first
    norms = []
    for device, device_grads in grads.items():
        ones = torch.ones(1, dtype=torch.float32, device=device)
        norms.append(torch.ops.gpuops.unscaled_grad_norm_(_norm_readable(device_grads), ones,
                                                          torch.zeros(1, dtype=torch.float32, device=device)))
    total_norm = torch.stack(norms).square().sum().sqrt() if len(norms) > 1 else norms[0].reshape(())
    total_norm = optimizer._gpuops_global_grad_norm(total_norm)
    clip_coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0).float().reshape(1)
    for device, device_grads in grads.items():
        torch.ops.gpuops.unscale_and_check_(device_grads, torch.zeros(1, device=device), clip_coef.to(device))
    return total_norm


# The scaler's loop methods run eagerly under torch.compile (a graph break at each call), as torch's GradScaler does
# (dynamo skips torch.amp.grad_scaler): they keep Python state (stages per optimizer, lazily made tensors) and
# hand the optimizer its scale and flag as attributes, which dynamo cannot replay. Their work is a few fused ops.
_eager = torch.compiler.disable


class GradScaler:
    """Dynamic loss scaling for fp16 training (and a no-op pass-through when ``enabled=False``). Under
    ``torch.compile`` its methods run eagerly, each a graph break, as torch's GradScaler's do."""

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True, *,
                 hysteresis: int = 1, min_scale: float = 0.0, max_scale: Optional[float] = None) -> None:
        # gpuops::amp::check_grad_scaler_options: the C++ scaler's rules and messages (NaN, inf and values
        # beyond float32 are refused, as is an init_scale outside [min_scale, max_scale]).
        _C.check_grad_scaler_options("GradScaler", dict(
            init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
            growth_interval=growth_interval, hysteresis=hysteresis, min_scale=min_scale, max_scale=max_scale))
        self._device = torch.device(device).type
        self._enabled = enabled
        if self._device == "cuda" and enabled and not torch.cuda.is_available():  # as torch's GradScaler does
            warnings.warn("gpuops.GradScaler is enabled, but CUDA is not available. Disabling. (GradScaler('cpu') "
                          "scales on the CPU.)")
            self._enabled = False
        self._init_scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = growth_interval
        self._hysteresis = hysteresis
        self._min_scale = float(min_scale)
        self._max_scale = float(max_scale) if max_scale is not None else 0.0
        self._init_growth_tracker = 0
        self._init_hysteresis_left = hysteresis
        self._init_skipped = 0
        self._scale: Optional[torch.Tensor] = None
        self._growth_tracker: Optional[torch.Tensor] = None
        self._hysteresis_left: Optional[torch.Tensor] = None
        self._skipped: Optional[torch.Tensor] = None
        self._step_applied: Optional[torch.Tensor] = None
        self._per_optimizer: Dict[int, dict] = defaultdict(self._fresh_optimizer_state)

    def _options(self, **changes) -> dict:
        options = dict(init_scale=self._init_scale, growth_factor=self._growth_factor,
                       backoff_factor=self._backoff_factor, growth_interval=self._growth_interval,
                       hysteresis=self._hysteresis, min_scale=self._min_scale, max_scale=self._max_scale)
        options.update(changes)
        return options

    def _checked(self, where: str, **changes) -> dict:
        """The options with `changes`, checked as the constructor checks them."""
        options = self._options(**changes)
        _C.check_grad_scaler_options(where, options)
        return options

    @staticmethod
    def _fresh_optimizer_state() -> dict:
        return {"stage": _Stage.READY, "found_inf_per_device": {}, "divisor": None}

    def _gradient_scale(self, state: dict) -> torch.Tensor:
        """What the optimizer's gradients are divided by: the loss scale, times a divisor if one was set."""
        return self._scale if state["divisor"] is None else self._scale * state["divisor"]

    @_eager
    def set_grad_divisor(self, optimizer: torch.optim.Optimizer, divisor) -> None:
        """Until the next update(), also divide this optimizer's gradients by ``divisor`` (a number or a
        one-element tensor; e.g. the sample or token count of an accumulation window), folded into the same
        unscale / clip / fused-step pass, so it costs no extra pass and no host sync. It must be a finite float32
        number > 0 (a device tensor's value is not read: no sync), on the CPU or the scale's device."""
        _check_optimizer("GradScaler.set_grad_divisor", optimizer)
        if self._scale is None:
            raise RuntimeError("GradScaler.set_grad_divisor() before any scale(): scale the loss first")
        state = self._per_optimizer[id(optimizer)]
        if state["stage"] is not _Stage.READY:
            raise RuntimeError("GradScaler.set_grad_divisor() must come before unscale_(), clip_grad_norm_() "
                               "and step() of this step")
        _C.check_positive_count(divisor, "GradScaler.set_grad_divisor", "divisor", str(self._scale.device))
        divisor = torch.as_tensor(divisor, dtype=torch.float32, device=self._scale.device).reshape(1)
        global_divisor = getattr(optimizer, "_gpuops_global_divisor", None)  # a sharded optimizer: mean of ranks'
        state["divisor"] = global_divisor(divisor) if global_divisor is not None else divisor

    def _lazy_init(self, device: torch.device) -> None:
        if self._scale is None:
            self._scale = torch.full((1,), self._init_scale, dtype=torch.float32, device=device)
            self._growth_tracker = torch.full((1,), self._init_growth_tracker, dtype=torch.int32, device=device)
            self._hysteresis_left = torch.full((1,), self._init_hysteresis_left, dtype=torch.int32, device=device)
            self._skipped = torch.full((1,), self._init_skipped, dtype=torch.int64, device=device)

    # ------------------------------------------------------------------------------------ the loop
    @_eager
    def scale(self, outputs):
        """Multiplies the outputs (usually the loss) by the scale factor."""
        if not self._enabled:
            return outputs

        def multiply(t: torch.Tensor) -> torch.Tensor:
            self._lazy_init(t.device)
            return t * self._scale.to(device=t.device, non_blocking=True)

        return _apply_to_tensors(outputs, multiply)

    @_eager
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides the optimizer's gradients by the scale in place and records whether any was inf/nan."""
        if not self._enabled:
            return
        _check_optimizer("GradScaler.unscale_", optimizer)
        state = self._per_optimizer[id(optimizer)]
        if state["stage"] is _Stage.UNSCALED:
            raise RuntimeError("GradScaler.unscale_() was already called for this optimizer since the last "
                               "update(); call it once per step, after backward() and before step()")
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("GradScaler.unscale_() was called after step(); call it before step(), "
                               "then update() ends the step")
        if state["stage"] is _Stage.CLIPPED:
            raise RuntimeError("GradScaler.unscale_() after clip_grad_norm_(): clip_grad_norm_ already accounts for "
                               "the scale; call step() next")
        if self._scale is None:
            raise RuntimeError("GradScaler.unscale_() before any scale(): scale the loss with scaler.scale(loss) "
                               "and call backward() first")
        self._record_found_inf(optimizer, state, self._gradient_scale(state).double().reciprocal().float())
        state["stage"] = _Stage.UNSCALED

    @staticmethod
    def _record_found_inf(optimizer, state: dict, inv_scale: torch.Tensor) -> None:
        """Multiplies the gradients by inv_scale (1: only checks) and records the inf/nan flag per device."""
        grads_by_device = _grads_by_device(optimizer)
        if not grads_by_device:
            raise RuntimeError("GradScaler: the optimizer has no gradients; call scaler.scale(loss).backward() "
                               "before unscale_() or step()")
        for device, grads in grads_by_device.items():
            found_inf = torch.zeros(1, dtype=torch.float32, device=device)
            torch.ops.gpuops.unscale_and_check_(grads, found_inf, inv_scale.to(device, non_blocking=True))
            state["found_inf_per_device"][device] = _global_found_inf(optimizer, found_inf)

    @_eager
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Optional[Any]:
        """Unscales if needed, then runs ``optimizer.step()`` unless a gradient was inf/nan.

        Returns what ``optimizer.step`` returns, or None when the step was skipped (as torch's does).
        """
        _check_optimizer("GradScaler.step", optimizer)
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("GradScaler.step() does not support a closure: compute the loss and backward() "
                               "before calling step()")
        if self._scale is None:
            raise RuntimeError("GradScaler.step() before any scale(): scale the loss with scaler.scale(loss) and call "
                               "backward() first")
        state = self._per_optimizer[id(optimizer)]
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("GradScaler.step() was already called for this optimizer since the last update(); "
                               "call update() to end the step")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            _refuse_the_old_hand_off(optimizer)
            return self._step_on_device(optimizer, state, args, kwargs)
        if state["stage"] is _Stage.READY:
            self.unscale_(optimizer)
        found = self._combined_found_inf(state)
        self._step_applied = found == 0
        result = None
        if not found.item():  # torch optimizers cannot skip on a device flag: one read, as in torch
            result = optimizer.step(*args, **kwargs)
        state["stage"] = _Stage.STEPPED
        return result

    def _step_on_device(self, optimizer, state: dict, args, kwargs):
        """The sync-free path: the optimizer divides by the scale as it reads the gradients and skips
        itself when the flag is set (gpuops.optim and torch's fused optimizers)."""
        if state["stage"] is _Stage.READY:
            self._record_found_inf(optimizer, state, torch.ones_like(self._scale))
            optimizer.grad_scale = self._gradient_scale(state)
        elif state["stage"] is _Stage.CLIPPED:
            optimizer.grad_scale = state["grad_scale"]  # scale / clip coefficient, from pass 1
        else:  # unscale_() already divided the gradients
            optimizer.grad_scale = None
        found = self._combined_found_inf(state)
        # 0-dim, as torch's scaler hands them: torch's fused optimizers subtract found_inf from their 0-dim
        # step counters in place, which a one-element [1] tensor cannot broadcast into.
        optimizer.found_inf = found.reshape(())
        try:
            result = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale, optimizer.found_inf
        self._step_applied = found == 0
        state["stage"] = _Stage.STEPPED
        return result

    @_eager
    def clip_grad_norm_(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """``unscale_`` + ``torch.nn.utils.clip_grad_norm_`` (L2) in one read of the gradients.

        Returns the total norm of the unscaled gradients (a device tensor, as torch's). With a fused
        optimizer (gpuops.optim) the gradients are not written: the optimizer's step divides them by
        ``scale / clip_coef`` as it reads them, so the whole AMP step is two passes over the gradients.
        """
        _check_optimizer("GradScaler.clip_grad_norm_", optimizer)
        if not _real_number("GradScaler.clip_grad_norm_", "max_norm", max_norm) > 0:
            raise ValueError(f"GradScaler.clip_grad_norm_: max_norm must be > 0, got {max_norm}")
        max_norm = float(max_norm)
        if not self._enabled:
            if getattr(optimizer, "_gpuops_global_grad_norm", None) is not None:
                return clip_sharded_grad_norm_(optimizer, max_norm)
            return clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], max_norm)
        state = self._per_optimizer[id(optimizer)]
        if state["stage"] is not _Stage.READY:
            raise RuntimeError("GradScaler.clip_grad_norm_() must come right after backward(), before unscale_() "
                               "and step(), once per step")
        if self._scale is None:
            raise RuntimeError("GradScaler.clip_grad_norm_() before any scale(): scale the loss first")
        gradient_scale = self._gradient_scale(state)
        inv_scale = gradient_scale.double().reciprocal().float()
        grads = _grads_by_device(optimizer)
        if not grads:
            raise RuntimeError("GradScaler.clip_grad_norm_: the optimizer has no gradients; call "
                               "scaler.scale(loss).backward() first")
        norms = []
        for device, device_grads in grads.items():
            found_inf = torch.zeros(1, dtype=torch.float32, device=device)
            norms.append(torch.ops.gpuops.unscaled_grad_norm_(_norm_readable(device_grads), inv_scale.to(device),
                                                              found_inf)
                         .to(self._scale.device, non_blocking=True))
            state["found_inf_per_device"][device] = _global_found_inf(optimizer, found_inf)
        total_norm = torch.stack(norms).square().sum().sqrt() if len(norms) > 1 else norms[0].reshape(())
        global_norm = getattr(optimizer, "_gpuops_global_grad_norm", None)
        if global_norm is not None:  # a sharded optimizer: the norm over every rank's shard
            total_norm = global_norm(total_norm)
        clip_coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0).float()
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            state["grad_scale"] = (gradient_scale / clip_coef).reshape(1)
            state["stage"] = _Stage.CLIPPED
        else:  # a torch optimizer reads the gradients as they are: write them unscaled and clipped, one pass
            factor = (inv_scale * clip_coef).reshape(1)
            for device, device_grads in grads.items():
                torch.ops.gpuops.unscale_and_check_(device_grads, torch.zeros(1, device=device), factor.to(device))
            state["stage"] = _Stage.UNSCALED
        return total_norm

    @_eager
    def update(self, new_scale: Union[float, torch.Tensor, None] = None) -> None:
        """Ends the step: backs the scale off after an overflow, grows it after growth_interval clean steps."""
        if not self._enabled:
            return
        if self._scale is None:
            raise RuntimeError("GradScaler.update() before any scale(): nothing to update")
        found_infs = [f for s in self._per_optimizer.values() for f in s["found_inf_per_device"].values()]
        found = (torch.stack([f.to(self._scale.device, non_blocking=True) for f in found_infs]).sum(0)
                 if found_infs else None)
        if new_scale is not None:
            _C.check_positive_count(new_scale, "GradScaler.update", "new_scale")
            if isinstance(new_scale, torch.Tensor):
                if new_scale.numel() != 1 or not new_scale.is_floating_point():
                    raise ValueError("GradScaler.update: new_scale must be a float or a one-element floating tensor")
                self._scale.copy_(new_scale.reshape(1))
            else:
                self._scale.fill_(float(new_scale))
        else:
            if found is None:
                raise RuntimeError("GradScaler.update(): no unscale_() or step() was recorded since the last update; "
                                   "call scaler.step(optimizer) before update()")
            torch.ops.gpuops.update_scale_(self._scale, self._growth_tracker, self._hysteresis_left, found,
                                           self._growth_factor, self._backoff_factor, self._growth_interval,
                                           self._hysteresis, self._min_scale, self._max_scale)
        if found is not None:  # a skipped step counts whoever sets the next scale
            self._skipped += (found > 0).to(torch.int64)
        self._per_optimizer = defaultdict(self._fresh_optimizer_state)

    @staticmethod
    def _combined_found_inf(state: dict) -> torch.Tensor:
        flags = list(state["found_inf_per_device"].values())
        return torch.stack([f.to(flags[0].device, non_blocking=True) for f in flags]).sum(0)

    # -------------------------------------------------------------------------------- accessors
    def get_scale(self) -> float:
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because of inf/nan gradients (reads the device counter)."""
        return self._init_skipped if self._skipped is None else int(self._skipped.item())

    @property
    def step_applied(self) -> Optional[torch.Tensor]:
        """The last step()'s outcome as a device bool tensor (no sync), or None before any step."""
        return self._step_applied

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = float(self._checked("GradScaler.set_growth_factor", growth_factor=new_factor)
                                    ["growth_factor"])

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = float(self._checked("GradScaler.set_backoff_factor", backoff_factor=new_factor)
                                     ["backoff_factor"])

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = int(self._checked("GradScaler.set_growth_interval", growth_interval=new_interval)
                                    ["growth_interval"])

    def is_enabled(self) -> bool:
        return self._enabled

    # -------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """torch's keys (so torch's GradScaler loads it) plus hysteresis and skipped-step state."""
        if not self._enabled:
            return {}
        tracker = self._init_growth_tracker if self._growth_tracker is None else int(self._growth_tracker.item())
        left = self._init_hysteresis_left if self._hysteresis_left is None else int(self._hysteresis_left.item())
        return {"scale": self.get_scale(), "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": tracker, "hysteresis": self._hysteresis, "_hysteresis_left": left,
                "min_scale": self._min_scale, "max_scale": self._max_scale, "_skipped_steps": self.skipped_steps}

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads ours or torch's state_dict; nothing changes if a key is missing or invalid: every value is read and
        checked first, by gpuops::amp::read_grad_scaler_state (as the C++ scaler's load_state_dict)."""
        if not self._enabled:
            return
        if not isinstance(state_dict, dict):
            raise TypeError(f"GradScaler.load_state_dict: state_dict must be a dict, got {type(state_dict).__name__}")
        loaded = _C.read_grad_scaler_state(state_dict, self._options())
        self._init_scale = float(loaded["init_scale"])
        self._growth_factor = float(loaded["growth_factor"])
        self._backoff_factor = float(loaded["backoff_factor"])
        self._growth_interval = int(loaded["growth_interval"])
        self._hysteresis = int(loaded["hysteresis"])
        self._min_scale = float(loaded["min_scale"])
        self._max_scale = float(loaded["max_scale"])
        self._init_growth_tracker = int(loaded["_growth_tracker"])
        self._init_hysteresis_left = int(loaded["_hysteresis_left"])
        self._init_skipped = int(loaded["_skipped_steps"])
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
            self._growth_tracker.fill_(self._init_growth_tracker)
            self._hysteresis_left.fill_(self._init_hysteresis_left)
            self._skipped.fill_(self._init_skipped)
