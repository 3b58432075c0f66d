"""Stage 3 of gpuops.ZeroOptimizer: which parameters form each unit, and the module hooks that gather a unit
around its forward and backward. The gathers, prefetches and frees themselves are C++ (ZeroShards'
unit_pre_forward / unit_post_forward / unit_pre_backward); this file only finds the units and calls them."""

from __future__ import annotations

import warnings
import weakref
from typing import Optional

import torch
from torch.utils._pytree import tree_flatten

from . import dist as _dist


def _unit_modules(model: torch.nn.Module, units) -> list:
    """The unit modules: the children of the container named by ``units`` (a dotted attribute path of
    ``model``, or the container itself), or the modules of a list."""
    if units is None:
        return []
    if isinstance(units, str):
        try:
            units = model.get_submodule(units)
        except AttributeError as error:
            raise ValueError(f"gpuops.ZeroOptimizer: units={units!r} names no submodule of the model ({error})") from None
    if isinstance(units, torch.nn.Module):
        return list(units.children())
    if isinstance(units, (str, bytes)) or not hasattr(units, "__iter__"):
        raise TypeError("gpuops.ZeroOptimizer: units must be a container's name (e.g. 'layers'), the container, or "
                        f"a list of submodules, got {type(units).__name__}")
    mods = list(units)
    inside = {id(m) for m in model.modules()}
    for i, m in enumerate(mods):
        if not isinstance(m, torch.nn.Module) or id(m) not in inside:
            raise ValueError(f"gpuops.ZeroOptimizer: units[{i}] must be a submodule of the model, got "
                             f"{type(m).__name__}")
    return mods


def unit_layout(model, units, params: list, names: list) -> tuple:
    """(unit of every parameter, the unit modules in unit order: None for unit 0 when it is the rest of the
    model). Unit 0 holds the parameters outside every unit module (embedding, final norm, head), so that it runs
    first in a forward; then each unit module in order. A parameter reachable from two units (tied, shared) is
    refused, naming it and both units: gathered by one unit, it would be a placeholder when the other runs."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError("gpuops.ZeroOptimizer: stage 3 needs model= (the nn.Module whose forward uses the "
                        f"parameters: its hooks gather each unit), got {type(model).__name__}")
    index = {id(p): i for i, p in enumerate(params)}
    label = (lambda i: repr(names[i])) if names else (lambda i: f"params[{i}] (shape {tuple(params[i].shape)})")
    owned = {id(p) for p in model.parameters()}
    outside = [i for i, p in enumerate(params) if id(p) not in owned]
    if outside:
        raise ValueError(f"gpuops.ZeroOptimizer: stage 3 shards the model's parameters; {label(outside[0])} (and "
                         f"{len(outside) - 1} more) is not a parameter of model")
    mods = _unit_modules(model, units)
    unit_names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    where: dict = {}  # parameter index -> unit module position
    for u, m in enumerate(mods):
        for p in m.parameters():
            i = index.get(id(p))
            if i is None:
                continue
            if i in where and where[i] != u:
                raise ValueError(f"gpuops.ZeroOptimizer: {label(i)} is shared by units "
                                 f"'{unit_names.get(id(mods[where[i]]))}' and '{unit_names.get(id(m))}' (a tied or "
                                 "shared parameter): put both users in one unit, or leave them outside the units")
            where[i] = u
    inner = {id(sub) for m in mods for sub in m.modules()}
    for name, sub in model.named_modules():  # the rest of the model must not reach a unit's parameter
        if id(sub) in inner:
            continue
        for pname, p in sub.named_parameters(recurse=False):
            i = index.get(id(p))
            if i is not None and i in where:
                raise ValueError(f"gpuops.ZeroOptimizer: {label(i)} belongs to unit '{unit_names.get(id(mods[where[i]]))}'"
                                 f" and is also used outside it as '{name + '.' if name else ''}{pname}' (a tied "
                                 "parameter): leave that unit out of units, or untie them")
    rest = [i for i in range(len(params)) if i not in where]
    used = sorted({where[i] for i in where})
    order = ([None] if rest else []) + [mods[u] for u in used]
    number = {u: n + (1 if rest else 0) for n, u in enumerate(used)}
    unit_of = [number[where[i]] if i in where else 0 for i in range(len(params))]
    return unit_of, order


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def install_unit_hooks(optimizer, model: torch.nn.Module, order: list) -> list:
    """Forward pre/post hooks on every unit module (unit 0, the rest, on the model itself) and, after each
    forward with autograd, a hook on its outputs' gradients that gathers the unit before its backward. They
    hold the optimizer weakly and go with it."""
    ref = weakref.ref(optimizer)

    def hooks_for(u: int):
        def pre(_module, _args):
            opt = ref()
            if opt is not None:
                opt._impl.unit_pre_forward(u)

        def post(_module, _args, output):
            opt = ref()
            if opt is None:
                return
            opt._impl.unit_post_forward(u)
            if not torch.is_grad_enabled() or _in_backward():
                return
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, lambda _grad: _pre_backward(u), mode="any")

        def _pre_backward(unit: int) -> None:
            opt = ref()
            if opt is not None:
                opt._impl.unit_pre_backward(unit)

        return pre, post

    handles = []
    for u, module in enumerate(order):
        target = model if module is None else module
        pre, post = hooks_for(u)
        handles.append(target.register_forward_pre_hook(pre))
        handles.append(target.register_forward_hook(post))
    weakref.finalize(optimizer, lambda: [h.remove() for h in handles])
    return handles


def sharded_names(model: torch.nn.Module, params: list) -> dict:
    """Every state_dict name of a sharded parameter (tied ones under each of their names) -> its index."""
    index = {id(p): i for i, p in enumerate(params)}
    return {n: index[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if id(p) in index}


def check_in_place(model: torch.nn.Module, names: dict, params: list) -> None:
    """ValueError when a sharded parameter is no longer the model's under its name: its module or the parameter
    itself was replaced after the optimizer was built (module assignment, load_state_dict(assign=True))."""
    now = dict(model.named_parameters(remove_duplicate=False))
    for name, i in names.items():
        if now.get(name) is not params[i]:
            raise ValueError(f"gpuops.ZeroOptimizer (stage 3): '{name}' is no longer the parameter the optimizer "
                             "shards (its module or the parameter was replaced after the optimizer was built): the "
                             "new one would train outside the optimizer, and state_dict() and full_state_dict() "
                             "would give the old values. Change the model before building the optimizer")


def install_layout_check(optimizer, model: torch.nn.Module, names: dict, params: list) -> list:
    """Before every forward of the model (ahead of unit 0's gather): check_in_place. One pass over the model's
    parameter names."""
    ref = weakref.ref(optimizer)

    def check(_module, _args):
        if ref() is not None:
            check_in_place(model, names, params)

    handle = model.register_forward_pre_hook(check, prepend=True)
    weakref.finalize(optimizer, handle.remove)
    return [handle]


def install_state_dict_hooks(optimizer, model: torch.nn.Module, names: dict) -> list:
    """model.state_dict() leaves the sharded parameters out (no rank holds them; a gather would be a collective
    that a rank-0-only call would leave waiting), warning once; model.load_state_dict() takes them when the dict
    has every one of them and does not report them missing when it has none (a state dict saved by state_dict()
    here, TrainingState's). Taking them is collective (each rank keeps its shard): every rank calls it with the
    same values, agreed on their fingerprint; a partial dict, a bad value or values that differ on any rank
    raise on every rank before anything of the model is loaded."""
    ref = weakref.ref(optimizer)

    def leave_out(_module, state_dict, prefix, _local_metadata):
        opt = ref()
        if opt is None or getattr(opt, "_keep_sharded", False):
            return
        removed = [prefix + n for n in names if state_dict.pop(prefix + n, None) is not None]
        if removed and not getattr(opt, "_warned_state_dict", False) and not getattr(opt, "_quiet_state_dict", False):
            opt._warned_state_dict = True
            warnings.warn(f"model.state_dict(): the {len(removed)} parameters sharded by gpuops.ZeroOptimizer "
                          f"(stage 3) are left out (the first: '{removed[0]}'); call opt.full_state_dict(to) on every "
                          "rank for the whole model, or save with gpuops.TrainingState", stacklevel=2)

    def take(_module, state_dict, prefix, _local_metadata, _strict, _missing, _unexpected, _error_msgs):
        # Raised here, before torch loads anything of the model: a failed load leaves every rank as it was.
        opt = ref()
        present = [n for n in names if prefix + n in state_dict]
        if opt is None or not present:
            return
        what = "ZeroOptimizer.load_full_parameters"  # its agreement: the ranks that have every value wait there
        if len(present) < len(names):
            absent = next(n for n in names if prefix + n not in state_dict)
            _dist.fail_together(opt.communicator, what, ValueError(
                f"model.load_state_dict: the state dict has {len(present)} of the {len(names)} parameters sharded by "
                f"gpuops.ZeroOptimizer (stage 3), not '{prefix + absent}': give all of them or none; nothing was "
                "loaded"))
        values = [None] * opt._impl.param_count
        for n in names:
            values[names[n]] = state_dict[prefix + n]
        opt._impl.load_full_parameters(values)
        for n in names:
            state_dict.pop(prefix + n)

    def not_missing(_module, incompatible):
        missing = set(incompatible.missing_keys)
        for n in names:  # (state_dict()'s prefix is "" at the model: the hooks sit on it)
            missing.discard(n)
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k in missing]

    handles = [model.register_state_dict_post_hook(leave_out),
               model.register_load_state_dict_pre_hook(take),
               model.register_load_state_dict_post_hook(not_missing)]
    weakref.finalize(optimizer, lambda: [h.remove() for h in handles])
    return handles


def full_state_dict(optimizer, model: torch.nn.Module, names: dict, to: int = 0) -> Optional[dict]:
    """The model's full state_dict on rank ``to``'s host memory (parameters gathered unit by unit; buffers and
    parameters outside the optimizer as the model holds them), in the model's order: what an unsharded model
    loads. None on the other ranks. Collective."""
    try:
        check_in_place(model, names, optimizer._params)
    except ValueError as error:  # the others wait in full_parameters' agreement: they hear of it there
        _dist.fail_together(optimizer.communicator, "ZeroOptimizer.full_parameters", error)
    values = optimizer._impl.full_parameters(to)
    if optimizer._impl.rank != to:
        return None
    optimizer._keep_sharded = True  # the placeholders stay in, in their places, to be replaced
    try:
        entries = model.state_dict(keep_vars=True)
    finally:
        optimizer._keep_sharded = False
    return {name: values[names[name]] if name in names else t.detach().to("cpu", copy=True)
            for name, t in entries.items()}
