"""Activation checkpointing for Python models, with the choice of what to checkpoint as the product.

``gpuops.checkpoint(fn, *args)`` runs ``fn`` without keeping its activations and recomputes them in the
backward, on the C++ engine LibTorch programs use (RNG and autocast state replayed: gradients are
bit-identical). Wrapped layers use torch.utils.checkpoint's non-reentrant engine (inputs need not require
grad there); what gpuops adds for them is the choice of layers. ``apply_checkpointing(layers, ...)`` wraps chosen layers of a stack (an ``nn.ModuleList`` or
``nn.Sequential``, e.g. a transformer's blocks) by policy:

* ``every=k``: layers 0, k, 2k, ...;
* ``names=[...]``: the layers whose index or name is listed;
* ``budget_bytes=B, sample=fn``: run ``sample()`` (one forward + backward of a representative batch) once,
  measure each layer's saved-activation bytes and forward time, and checkpoint the set of layers whose
  activations then fit in B bytes with the least recomputation time (exact 0/1 knapsack over byte units).

``remove_checkpointing(layers)`` undoes it.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Sequence, Union

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from . import _C


def _module_of(fn) -> Optional[torch.nn.Module]:
    """The module fn is, or whose bound method it is (checkpoint(block, x) or checkpoint(block.forward, x))."""
    if isinstance(fn, torch.nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


def checkpoint(fn: Callable, *args, use_reentrant: Optional[bool] = None, preserve_rng_state: bool = True,
               buffers: Sequence[torch.Tensor] = (), offload: bool = False, **kwargs):
    """``fn(*args, **kwargs)`` without saving its activations; they are recomputed in the backward.

    By default the C++ engine runs it (gpuops::checkpoint, the one LibTorch programs use): a reentrant node
    that keeps only the tensor arguments and replays the RNG (CPU and every CUDA device) and autocast state,
    so gradients are bit-identical. ``buffers``: tensors ``fn`` updates in place (BatchNorm statistics),
    restored after the recomputation so they change once; when ``fn`` is an ``nn.Module`` or a bound method
    of one, its buffers are protected so without being listed. Non-tensor arguments are passed through;
    ``fn`` returns a value or a tuple/list of values, of which the tensors get gradients (as torch's).
    As torch's reentrant checkpoint: with no tensor argument requiring grad it warns and its outputs need no
    grad; the backward raises a RuntimeError when no recomputed output requires grad; and it works with
    ``backward()``, not ``torch.autograd.grad(..., inputs)`` (a RuntimeError says so, as torch's). ``use_reentrant=False``
    delegates to torch.utils.checkpoint's non-reentrant implementation, which has none of these limits.
    Without ``use_reentrant`` it warns, as torch's checkpoint does, and runs the reentrant engine.
    ``offload=True`` (reentrant engine): the tensor arguments it keeps go to host memory (pinned beside a GPU)
    until the backward brings them back, so the device holds nothing of the segment in between (Unsloth's
    offloaded checkpointing).
    """
    if use_reentrant is None:
        warnings.warn("gpuops.checkpoint: pass use_reentrant explicitly, as torch.utils.checkpoint asks: True (the "
                      "default here) runs the reentrant C++ engine, with the limits of torch's reentrant checkpoint; "
                      "False runs torch's non-reentrant one", stacklevel=2)
        use_reentrant = True
    if not isinstance(use_reentrant, bool):
        raise TypeError(f"gpuops.checkpoint: use_reentrant must be True or False, got {use_reentrant!r}")
    if not callable(fn):
        raise TypeError(f"gpuops.checkpoint: fn must be callable, got {type(fn).__name__}")
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(f"gpuops.checkpoint: preserve_rng_state must be True or False, got {preserve_rng_state!r}")
    if isinstance(buffers, torch.Tensor) or not isinstance(buffers, (list, tuple)) or not all(
            isinstance(b, torch.Tensor) for b in buffers):
        raise TypeError(f"gpuops.checkpoint: buffers must be a list or tuple of tensors, got {buffers!r:.80}")
    if not isinstance(offload, bool):
        raise TypeError(f"gpuops.checkpoint: offload must be True or False, got {offload!r}")
    if offload and not use_reentrant:
        raise ValueError("gpuops.checkpoint: offload=True keeps the inputs in host memory through the reentrant "
                         "engine; use use_reentrant=True with it")
    if not use_reentrant:
        return _torch_checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs)
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    protected = list(buffers)
    module = _module_of(fn)
    if module is not None:  # its running statistics would otherwise be updated by the recomputation too
        listed = {id(b) for b in protected}
        protected += [b for b in module.buffers() if id(b) not in listed]
    layout = {}  # where the forward's tensors sit among its other returned values
    # The node keeps `segment` for the recomputation: it holds the non-tensor arguments only (the tensors come
    # back through the engine, which may keep them in host memory: offload).
    skeleton = [None if isinstance(a, torch.Tensor) else a for a in args]

    def segment(tensors):
        call = list(skeleton)
        for i, t in zip(positions, tensors):
            call[i] = t
        out = fn(*call, **kwargs)
        items = list(out) if isinstance(out, (tuple, list)) else [out]
        tensor_at = [i for i, o in enumerate(items) if isinstance(o, torch.Tensor)]
        if not layout:  # the forward: keep the other values (not the tensors, which the engine returns)
            layout.update(kind=type(out) if isinstance(out, (tuple, list)) else None, tensor_at=tensor_at,
                          items=[None if isinstance(o, torch.Tensor) else o for o in items])
        elif tensor_at != layout["tensor_at"]:
            raise RuntimeError(f"gpuops.checkpoint: the recomputation returned tensors at positions {tensor_at}, the "
                               f"forward at {layout['tensor_at']}; the segment must be deterministic in its structure")
        return [items[i] for i in tensor_at]

    tensors = [args[i] for i in positions]
    del args  # (the frame would keep them alive while the forward's outputs live)
    outs = _C.checkpoint_segment(segment, tensors, preserve_rng_state, protected, offload)
    del tensors
    items = list(layout["items"])
    for i, t in zip(layout["tensor_at"], outs):
        items[i] = t
    kind = layout["kind"]
    if kind is None:
        return items[0]
    return kind(*items) if hasattr(kind, "_fields") else kind(items)  # a namedtuple takes its fields


def _named_layers(layers) -> List[tuple]:
    if isinstance(layers, (torch.nn.ModuleList, torch.nn.Sequential)):
        return list(layers.named_children())
    if isinstance(layers, Sequence) and all(isinstance(m, torch.nn.Module) for m in layers):
        return [(str(i), m) for i, m in enumerate(layers)]
    raise ValueError("apply_checkpointing: layers must be an nn.ModuleList, an nn.Sequential or a list of modules, "
                     f"got {type(layers).__name__}")


def _wrap(module: torch.nn.Module, offload: bool = False) -> None:
    if "_gpuops_forward" in module.__dict__:
        return
    original = module.forward
    module._gpuops_forward = original
    module._gpuops_offload_inputs = offload  # (what a failed budget call wraps again)

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():  # inference: nothing to save, nothing to recompute
            return original(*args, **kwargs)
        if offload:  # our reentrant engine keeps the inputs on the host: one of them must carry the gradient
            if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                raise ValueError("apply_checkpointing(offload=True): no tensor argument of this layer requires grad "
                                 "(frozen embeddings, LoRA), so its parameters would get no gradient through the "
                                 "reentrant engine that offloads; make the first layer's input require grad (Hugging "
                                 "Face: model.enable_input_require_grads()) or use offload=False")
            return checkpoint(original, *args, use_reentrant=True, offload=True, **kwargs)
        # torch's non-reentrant engine here: a layer's inputs need not require grad (frozen embeddings).
        return checkpoint(original, *args, use_reentrant=False, **kwargs)

    module.forward = forward


def remove_checkpointing(layers) -> None:
    """Restores the plain forward of every layer apply_checkpointing wrapped."""
    for _, module in _named_layers(layers):
        if "_gpuops_forward" in module.__dict__:
            del module.forward
            del module._gpuops_forward
            del module._gpuops_offload_inputs


@dataclass(frozen=True)
class LayerCost:
    """What checkpointing one layer trades: saved bytes given back against forward time recomputed."""

    name: str
    saved_bytes: int       # activations the layer saves for backward
    checkpointed_bytes: int  # what a checkpointed layer keeps instead (its inputs)
    forward_seconds: float  # the recomputation it costs
    offloaded_bytes: int = 0  # what an offloaded layer keeps on the device (tensors under min_bytes)
    offload_seconds: float = -1.0  # its copies to the host and back, not overlapped (< 0: not measured)


def measure_layers(layers, sample: Callable[[], None], min_bytes: int = 1024) -> List[LayerCost]:
    """Runs ``sample()`` once (a forward and backward of a representative batch) and measures, per layer,
    the bytes of the tensors autograd saves inside it (each storage counted once), its forward time, and what
    offloading them would take (offload_activations with ``min_bytes``): the bytes that would stay and the time
    of copying the others to host memory (pinned beside a GPU) and back, one after the other (an upper bound of
    what the overlapped copies cost), left out of the forward time."""
    named = _named_layers(layers)
    weights = {p.untyped_storage().data_ptr() for _, m in named for p in m.parameters()}  # not activations
    saved = {name: {} for name, _ in named}
    staying = {name: {} for name, _ in named}  # (offloaded) the tensors under min_bytes
    inputs = {name: 0 for name, _ in named}
    seconds = {name: 0.0 for name, _ in named}
    copies = {name: 0.0 for name, _ in named}
    copied = {name: set() for name, _ in named}
    current: List[Optional[str]] = [None]

    def pack(t: torch.Tensor):
        if current[0] is not None and isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            if storage.data_ptr() not in weights:
                saved[current[0]][storage.data_ptr()] = storage.nbytes()
                if t.nbytes < min_bytes:
                    staying[current[0]][storage.data_ptr()] = storage.nbytes()
                elif (storage.data_ptr(), t.storage_offset(), t.shape) not in copied[current[0]]:  # (one copy)
                    copied[current[0]].add((storage.data_ptr(), t.storage_offset(), t.shape))
                    copies[current[0]] += _copy_seconds(t)
        return t

    handles, starts = [], {}

    def sync(tensors) -> None:
        """CUDA kernels run asynchronously: a layer's time is its kernels', not their launches'."""
        for device in {t.device for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda}:
            torch.cuda.synchronize(device)

    for name, module in named:
        def pre(mod, args, name=name):
            current[0] = name
            inputs[name] = sum(a.untyped_storage().nbytes() for a in args if isinstance(a, torch.Tensor))
            sync(args)
            starts[name] = time.perf_counter()

        def post(mod, args, out, name=name):
            sync(out if isinstance(out, (tuple, list)) else [out])
            seconds[name] += time.perf_counter() - starts[name]
            current[0] = None

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            sample()
    finally:
        for h in handles:
            h.remove()
    return [LayerCost(name, sum(saved[name].values()), inputs[name], max(seconds[name] - copies[name], 0.0),
                      sum(staying[name].values()), copies[name]) for name, _ in named]


def _copy_seconds(t: torch.Tensor) -> float:
    """The time of one saved tensor's copy to host memory and back, as offload_activations makes them."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
    if t.is_cuda:
        torch.cuda.synchronize(t.device)
    start = time.perf_counter()
    host.copy_(t.detach(), non_blocking=t.is_cuda)
    back = host.to(t.device, non_blocking=t.is_cuda, copy=True)
    if t.is_cuda:
        torch.cuda.synchronize(t.device)
    del back
    return time.perf_counter() - start


def choose_for_budget(costs: Sequence[LayerCost], budget_bytes: int, units: int = 1 << 16) -> List[str]:
    """The layers to checkpoint so that the saved activations fit in ``budget_bytes`` with the least
    recomputation time: the C++ engine's 0/1 knapsack (gpuops::choose_for_budget), exact up to savings rounded
    down to 1/``units`` of their total (so the choice never saves less than it counts). Raises ValueError when even checkpointing every layer does
    not fit."""
    rows = [(c.name, int(c.saved_bytes), int(c.checkpointed_bytes), float(c.forward_seconds)) for c in costs]
    return [costs[i].name for i in _C.choose_for_budget(rows, int(budget_bytes), int(units))]


def apply_checkpointing(layers, *, every: Optional[int] = None, names: Optional[Iterable[Union[int, str]]] = None,
                        budget_bytes: Optional[int] = None, sample: Optional[Callable[[], None]] = None,
                        offload: bool = False) -> List[str]:
    """Checkpoints the layers the one given policy selects; returns their names (indices as strings for a
    ModuleList or Sequential). ``offload=True``: each chosen layer's inputs also wait in host memory until its
    backward (gpuops.checkpoint's offload; the reentrant engine, so a layer's input must require grad)."""
    if not isinstance(offload, bool):
        raise TypeError(f"apply_checkpointing: offload must be True or False, got {offload!r}")
    given = [every is not None, names is not None, budget_bytes is not None]
    if sum(given) != 1:
        raise ValueError("apply_checkpointing: give exactly one policy: every=k, names=[...] or budget_bytes=B "
                         "with sample=fn")
    named = _named_layers(layers)
    # The choice is made in full before the previous one is removed: a failed call changes nothing.
    if every is not None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"apply_checkpointing: every must be an int >= 1, got {every!r}")
        chosen = [name for i, (name, _) in enumerate(named) if i % every == 0]
    elif names is not None:
        if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):  # "01" is not layers "0" and "1"
            raise TypeError(f"apply_checkpointing: names must be a list of layer names or indices, got {names!r:.80}")
        wanted = {str(n) for n in names}
        known = {name for name, _ in named}
        unknown = sorted(wanted - known)
        if unknown:
            raise ValueError(f"apply_checkpointing: names {unknown} are not layers; accepted: {sorted(known)}")
        chosen = [name for name, _ in named if name in wanted]
    else:
        if not callable(sample):
            raise ValueError("apply_checkpointing: budget_bytes needs sample=fn (one forward + backward), got "
                             f"sample={sample!r:.80}")
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"apply_checkpointing: budget_bytes must be an int >= 0, got {budget_bytes!r}")
        with _measured_without_checkpointing(layers) as named_measured:
            chosen = choose_for_budget(measure_layers(named_measured, sample), budget_bytes)
    offloaded = [name for name, module in named if name in chosen and "_gpuops_offloaded" in module.__dict__]
    if offloaded:
        raise ValueError(f"apply_checkpointing: layers {offloaded} offload their activations (offload_activations); "
                         "a layer either keeps them on the host or recomputes them: remove() the offload first")
    remove_checkpointing(layers)  # a new policy replaces the previous choice
    for name, module in named:
        if name in chosen:
            _wrap(module, offload)
    _turn_off_kv_cache([module for name, module in named if name in chosen])
    return chosen


@contextlib.contextmanager
def _measured_without_checkpointing(layers):
    """The layers' plain forward while a budget policy measures them; the previous checkpointing wrapped again
    when the measurement or the choice fails (a failed call changes nothing)."""
    previous = [(module, module._gpuops_offload_inputs) for _, module in _named_layers(layers)
                if "_gpuops_forward" in module.__dict__]
    remove_checkpointing(layers)
    try:
        yield layers
    except BaseException:
        for module, offload in previous:
            _wrap(module, offload)
        raise


def _turn_off_kv_cache(modules) -> None:
    """Hugging Face models keep a key/value cache in training while config.use_cache is True (their default): a
    checkpointed layer's recomputation writes it a second time, and the backward fails with torch's opaque
    CheckpointError. As transformers' gradient_checkpointing_enable() does, the cache is turned off, with a
    warning (a use_cache=True passed to the forward call itself still breaks it)."""
    seen = set()
    for module in modules:
        for sub in module.modules():
            config = getattr(sub, "config", None)
            if config is None or id(config) in seen:
                continue
            seen.add(id(config))
            if getattr(config, "use_cache", None) is True:
                config.use_cache = False
                warnings.warn("apply_checkpointing: the model's config.use_cache was True (Hugging Face's default), "
                              "which a checkpointed layer's recomputation breaks; set to False, as transformers' "
                              "gradient_checkpointing_enable() does", stacklevel=3)
