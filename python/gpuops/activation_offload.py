"""Activation offload (issue 33): the tensors autograd saves inside chosen layers wait in host memory between
the forward and the backward, and come back during the backward with the next layers' prefetched
(torchtune's activation offloading, per layer). Neither kept on the device nor recomputed: the third choice
beside plain and checkpointed layers. The store (copies, streams and events, deduplication, prefetch, the
timeline) is C++ (gpuops::ActivationOffloader); this file installs the saved-tensor hooks that call it, which
LibTorch offers to Python only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Union

import torch

from . import _C
from .checkpointing import _measured_without_checkpointing, _named_layers, apply_checkpointing, measure_layers


class _Saved:
    """What autograd keeps in place of an offloaded tensor: its handle in the store; freed with the saved
    variable (the graph's node ran, or the graph was dropped), which releases the store's copies."""

    __slots__ = ("store", "handle")

    def __init__(self, store, handle: int):
        self.store, self.handle = store, handle

    def __del__(self):
        self.store.release(self.handle)


class OffloadedActivations:
    """The layers whose activations go to host memory (gpuops.offload_activations); ``remove()`` restores their
    plain forward."""

    def __init__(self, modules: List[tuple], store) -> None:
        self._modules = modules
        self._store = store

    @property
    def names(self) -> List[str]:
        return [name for name, _ in self._modules]

    @property
    def host_bytes(self) -> int:
        """Bytes of activations held in host memory now."""
        return self._store.host_bytes

    @property
    def device_bytes(self) -> int:
        """Bytes of offloaded activations brought back to the device and not yet released by the backward."""
        return self._store.device_bytes

    def timeline(self) -> list:
        """The last forward's and backward's copies: ``(what, layer, bytes, begin_s, end_s)`` with what one of
        "to host", "prefetch", "back on demand" and layer the position among the offloaded layers."""
        return self._store.timeline()

    def remove(self) -> None:
        for _, module in self._modules:
            if module.__dict__.get("_gpuops_offloaded") is self._store:
                del module.forward
                del module._gpuops_offloaded


def offload_activations(layers, names: Optional[Iterable[Union[int, str]]] = None, *, min_bytes: int = 1024,
                        prefetch: int = 1) -> OffloadedActivations:
    """The activations saved inside the given layers of a stack (an nn.ModuleList or nn.Sequential, or a list of
    modules; ``names``: which ones, all by default) wait in host memory (pinned beside a GPU, copied on a side
    stream) from their forward to their backward. During the backward, when a layer's first activation is
    needed, those of the ``prefetch`` layers whose backward comes next start coming back. Tensors of fewer than
    ``min_bytes`` bytes and the layers' own parameters (and views of them) stay. Gradients are the bits of the
    plain layers'; a tensor changed in place after it was saved is refused at the backward, as torch refuses it.
    A checkpointed layer (apply_checkpointing) is refused: it keeps no activations to offload."""
    named = _named_layers(layers)
    if names is not None:
        if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
            raise TypeError(f"offload_activations: names must be a list of layer names or indices, got {names!r:.80}")
        wanted = {str(n) for n in names}
        unknown = sorted(wanted - {name for name, _ in named})
        if unknown:
            raise ValueError(f"offload_activations: names {unknown} are not layers; accepted: "
                             f"{[name for name, _ in named]}")
        named = [(name, m) for name, m in named if name in wanted]
    for name, module in named:
        if "_gpuops_forward" in module.__dict__:
            raise ValueError(f"offload_activations: layer '{name}' is checkpointed (apply_checkpointing): it keeps "
                             "no activations to offload; remove_checkpointing first, or leave it out")
        if "_gpuops_offloaded" in module.__dict__:
            raise ValueError(f"offload_activations: layer '{name}' is offloaded already; remove() that first")
    store = _C.ActivationOffloader(min_bytes, prefetch)
    for position, (_, module) in enumerate(named):
        _wrap(module, store, position)
    return OffloadedActivations(named, store)


def _wrap(module: torch.nn.Module, store, position: int) -> None:
    original = module.forward

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():  # inference: nothing is saved
            return original(*args, **kwargs)
        weights = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}

        def pack(t: torch.Tensor):
            if t.untyped_storage().data_ptr() in weights:  # a parameter: it stays on the device anyway
                return t
            handle = store.pack(t)
            return t if handle < 0 else _Saved(store, handle)

        def unpack(saved):
            return store.unpack(saved.handle) if isinstance(saved, _Saved) else saved

        store.enter_layer(position)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                return original(*args, **kwargs)
        finally:
            store.leave_layer()

    module.forward = forward
    module._gpuops_offloaded = store


@dataclass
class ActivationPlan:
    """What apply_activation_policy chose: per layer name "keep", "offload" or "recompute"; ``offloaded`` holds
    the offloaded layers' handle (None when none is)."""

    choices: Dict[str, str]
    offloaded: Optional[OffloadedActivations]


def apply_activation_policy(layers, budget_bytes: int, sample: Callable[[], None], *, min_bytes: int = 1024,
                            prefetch: int = 1) -> ActivationPlan:
    """The budget policy with three choices per layer: ``sample()`` (one forward and backward of a
    representative batch) measures each layer's saved bytes, its forward time (what recomputing costs) and the
    time of copying its activations to the host and back (what offloading costs, not overlapped: an upper
    bound); the C++ solver (gpuops::choose_placements) then keeps, offloads or recomputes each layer so that
    what the layers hold between forward and backward fits in ``budget_bytes`` with the least time. The
    recomputed layers are checkpointed (apply_checkpointing), the offloaded ones offload_activations' with
    ``min_bytes`` and ``prefetch``. ValueError when even the smallest choice for every layer does not fit (the
    error names the least budget that does), with nothing changed; a layer offloaded already is refused."""
    named = _named_layers(layers)
    offloaded = [name for name, module in named if "_gpuops_offloaded" in module.__dict__]
    if offloaded:
        raise ValueError(f"apply_activation_policy: layers {offloaded} are offloaded already; remove() that plan "
                         "first")
    if not callable(sample):
        raise ValueError(f"apply_activation_policy: sample must be a callable (one forward + backward), got "
                         f"{sample!r:.80}")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"apply_activation_policy: budget_bytes must be an int >= 0, got {budget_bytes!r}")
    _C.ActivationOffloader(min_bytes, prefetch)  # min_bytes and prefetch checked before anything runs
    with _measured_without_checkpointing(layers):
        costs = measure_layers(layers, sample, min_bytes)
        rows = [(c.name, c.saved_bytes, c.checkpointed_bytes, c.forward_seconds, c.offloaded_bytes,
                 c.offload_seconds) for c in costs]
        choices = dict(zip((c.name for c in costs), _C.choose_placements(rows, budget_bytes)))
    apply_checkpointing(layers, names=[name for name, c in choices.items() if c == "recompute"])
    offload = [name for name, c in choices.items() if c == "offload"]
    handle = offload_activations(layers, offload, min_bytes=min_bytes, prefetch=prefetch) if offload else None
    return ActivationPlan(choices, handle)
