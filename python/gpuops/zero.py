"""gpuops.ZeroOptimizer: ZeRO stages 1 and 2 (issue 13) over a communicator, for AdamW, Adam or SGD.

    import torch.distributed as dist, gpuops
    dist.init_process_group("gloo")                    # torchrun, or any launcher
    opt = gpuops.ZeroOptimizer(model.parameters(), gpuops.optim.AdamW, stage=2, lr=1e-3)
    scaler = gpuops.GradScaler("cpu")
    for x, y in data:
        opt.zero_grad()
        scaler.scale(loss_fn(model(x), y)).backward()
        scaler.clip_grad_norm_(opt, 1.0)               # the global norm, over every rank's shard
        scaler.step(opt)                               # reduce-scatter, fused step on the shard, all-gather
        scaler.update()

The work is done by the C++ class ``gpuops::optim::ZeroOptimizer<Base>`` (``gpuops._C.ZeroOptimizer``); this
class only adds what torch.optim code and our GradScaler look for. It is a ``torch.optim.Optimizer`` with one
group whose ``params`` are this rank's shard parameters (fp32; their ``.grad`` is the reduced gradient shard),
so torch's LR schedulers drive it (the group's options are read at every step: ``lr``, and ``betas`` or
``momentum`` that OneCycleLR and CyclicLR cycle, checked as at construction). The model's parameters become views of flat buffers padded to a multiple of the world size;
every rank must pass the same parameters. float16/bfloat16 parameters are stepped on fp32 master shards, their
gradients reduced in fp32.

State: as torch's ZeroRedundancyOptimizer, ``consolidate_state_dict(to)`` (every rank) then ``state_dict()``
(on rank ``to``) give the full per-parameter state that torch's own optimizer of the same kind loads;
``load_state_dict`` takes such a full state on every rank (each keeps its shard). ``save_shard`` /
``load_shards`` write and read one file per rank (resharding to another world size when allowed), which is
what gpuops.TrainingState does with this optimizer.

``offload="cpu"`` (stages 1-3) keeps the fp32 shard parameters and the optimizer state
in host memory: each bucket's gradient is copied there after its reduction (with ``reduce_in_backward``, during
the backward: the micro-batches summed on the host), stepped by the CPU kernels, and
copied back; ``offload_timeline()`` says when each ran.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Callable, Optional, Union

import torch

from . import _C
from . import dist as _dist
from .amp import clip_sharded_grad_norm_
from .zero_units import (full_state_dict, install_layout_check, install_state_dict_hooks, install_unit_hooks,
                         sharded_names, unit_layout)

_KIND_NAMES = {"adamw": "adamw", "adam": "adam", "sgd": "sgd"}


def _kind_of(optimizer_class) -> str:
    """'adamw', 'adam' or 'sgd' from a name or a class (ours, torch.optim's, or a subclass of them)."""
    if isinstance(optimizer_class, str):
        kind = _KIND_NAMES.get(optimizer_class.lower())
        if kind is None:
            raise ValueError(f"gpuops.ZeroOptimizer: optimizer_class must be AdamW, Adam or SGD (a class of "
                             f"gpuops.optim or torch.optim, or its name), got {optimizer_class!r}")
        return kind
    from . import optim as ours

    for kind, classes in (("adamw", (ours.AdamW, torch.optim.AdamW)), ("adam", (ours.Adam, torch.optim.Adam)),
                          ("sgd", (ours.SGD, torch.optim.SGD))):
        if isinstance(optimizer_class, type) and issubclass(optimizer_class, classes):
            return kind
    raise TypeError(f"gpuops.ZeroOptimizer: optimizer_class must be AdamW, Adam or SGD (a class of gpuops.optim "
                    f"or torch.optim, or its name), got {optimizer_class!r}")


def _wait_hooks(optimizer, module: torch.nn.Module, params: list) -> list:
    """Forward pre-hooks that wait for each submodule's own parameters (the ones this optimizer owns), and a
    state_dict pre-hook on ``module`` that waits for all. They hold the optimizer weakly and go with it."""
    ref = weakref.ref(optimizer)
    ours = {id(p) for p in params}

    def waiter(own: list):
        def hook(*_args, **_kwargs):
            opt = ref()
            if opt is not None:
                opt._impl.wait_for_parameters(own)
        return hook

    handles = []
    for sub in module.modules():
        own = [p for p in sub.parameters(recurse=False) if id(p) in ours]
        if own:
            handles.append(sub.register_forward_pre_hook(waiter(own)))
    handles.append(module.register_state_dict_pre_hook(waiter(None)))
    weakref.finalize(optimizer, lambda: [h.remove() for h in handles])  # the model outlives its optimizers
    return handles


def _split_names(params) -> tuple:
    """Tensors and their names from ``params``: tensors, or (name, tensor) pairs as ``named_parameters()`` gives
    (torch.optim takes those too); names are recorded in checkpoints."""
    if isinstance(params, (str, bytes, torch.Tensor)) or not hasattr(params, "__iter__"):
        raise TypeError("gpuops.ZeroOptimizer: params must be an iterable of tensors or (name, tensor) pairs (e.g. "
                        f"model.parameters()), got {type(params).__name__}")
    items = list(params)
    if items and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in items):
        return [p for _, p in items], [n for n, _ in items]
    if any(isinstance(p, (tuple, dict)) for p in items):
        raise TypeError("gpuops.ZeroOptimizer: params must be tensors or (name, tensor) pairs, all of one kind "
                        "(one group over the flat buckets: param group dicts are not supported)")
    return items, []


class ZeroOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` (AdamW by default; Adam, SGD) with its state (and the gradients, stage 2) sharded
    over the ranks of ``communicator`` (a ``gpuops.dist.Communicator``, a ``torch.distributed`` group, or None:
    the default group, or one rank of its own when torch.distributed is not initialized: the single-process
    form, e.g. for ``offload="cpu"`` on one GPU). ``**defaults``: the optimizer's options, as torch.optim names
    them.

    ``reduce_in_backward``: reduce each bucket of ``bucket_bytes`` from autograd hooks as soon as its gradients
    are complete, in every backward pass (overlap; stage 2 then never holds the whole gradient, at one
    reduce-scatter per micro-batch); False: once per step, after the accumulation window.

    ``overlap_param_gather``: the model (an ``nn.Module``) to overlap the parameters' all-gathers after each
    step with its next forward (Megatron's overlap_param_gather): the step launches them without waiting, and a
    forward pre-hook on every submodule waits for the buckets of that submodule's own parameters before it
    runs; ``state_dict()`` of the model, this optimizer's other calls and TrainingState wait for all. Until
    then the parameters hold their values from before the step: code that reads a parameter outside its
    module's forward calls ``wait_for_parameters()`` first. ``True`` overlaps without hooks (the caller waits);
    False (the default) waits at the end of the step.

    ``stage=3`` shards the parameters too (docs/architecture.md, "ZeRO stage 3"): ``model`` is the module whose
    forward uses them (its hooks gather each unit), ``units`` the container whose children are the units (a
    dotted name such as ``"model.layers"``, the container, or a list of submodules; the rest of the model is one
    more unit, gathered first); ``prefetch`` units are gathered ahead of the one running; ``reshard_after_forward``
    frees each unit after its forward (False keeps it for the backward); ``device`` puts the shards and the
    gathered units on that device when the model was built elsewhere (on the CPU: it is flattened there one unit
    at a time; move its buffers with ``model.to(device)`` afterwards). ``reduce_in_backward`` defaults to True
    at stage 3 (each unit reduced as its backward ends; False accumulates a unit's full gradients over the window).
    ``check_unit_order``: before each unit's gather the ranks compare which unit they gather and what for, so that
    ranks running different units (LayerDrop with a seed per rank, an extra forward on one rank) raise together
    naming them instead of Gloo aborting the process; False saves one small host-read collective per unit gather
    (its latency: 0.9 ms over Gloo on a 2-vCPU machine, docs/benchmarks.md). Every rank calls
    ``model.load_state_dict`` alike (agreed), and the model stays as it was built (a replaced unit is refused).
    Between steps the parameters are empty placeholders: ``full_state_dict(to)`` gathers the model."""

    _step_supports_amp_scaling = True  # GradScaler hands over grad_scale and found_inf, no host sync
    _reduced_for_scaler = False  # class default: copies and unpickled optimizers start without a pending check

    def __init__(self, params, optimizer_class=None, communicator=None, stage: int = 1, *,
                 reduce_in_backward: Optional[bool] = None, bucket_bytes: int = 25 * 2**20,
                 overlap_param_gather: Union[bool, torch.nn.Module] = False, model: Optional[torch.nn.Module] = None,
                 units=None, prefetch: int = 1, reshard_after_forward: bool = True,
                 device: Union[None, str, torch.device] = None, check_unit_order: bool = True,
                 offload: Optional[str] = None, **defaults) -> None:
        if communicator is None and not torch.distributed.is_initialized():
            communicator = _dist.Communicator(_dist.one_rank_group())  # the single-process form: one rank
        elif communicator is None or isinstance(communicator, torch.distributed.ProcessGroup):
            communicator = _dist.Communicator(communicator)
        if not isinstance(communicator, _C.Communicator):  # no way to reach the other ranks: this one raises alone
            raise TypeError("gpuops.ZeroOptimizer: communicator must be a gpuops.dist.Communicator, a "
                            f"torch.distributed group or None, got {type(communicator).__name__}")
        try:  # a bad argument on this rank reaches every rank, waiting in the construction's agreement
            kind = _kind_of(optimizer_class if optimizer_class is not None else "adamw")
            params, names = _split_names(params)
            unit_of, unit_order = [], []
            if stage == 3:
                unit_of, unit_order = unit_layout(model, units, params, names)
            elif model is not None or units is not None:
                raise ValueError(f"gpuops.ZeroOptimizer: model= and units= are for stage 3 (parameters sharded), "
                                 f"got stage={stage!r}")
            if device is not None and not isinstance(device, (str, torch.device)):
                raise TypeError(f"gpuops.ZeroOptimizer: device must be a str, a torch.device or None, got "
                                f"{type(device).__name__}")
            try:
                device = "" if device is None else str(torch.device(device))
            except RuntimeError:
                raise ValueError(f"gpuops.ZeroOptimizer: device must name a device ('cuda', 'cuda:1', 'cpu'), got "
                                 f"{device!r}") from None
            if offload is not None and not isinstance(offload, str):
                raise TypeError(f"gpuops.ZeroOptimizer: offload must be None or 'cpu', got {type(offload).__name__}")
            if reduce_in_backward is None:  # stage 3: each unit's gradients reduced as soon as its backward is done
                reduce_in_backward = stage == 3
            module = overlap_param_gather if isinstance(overlap_param_gather, torch.nn.Module) else None
            if module is not None:  # its forward pre-hooks are what waits: every parameter must be the module's
                owned = {id(p) for p in module.parameters()}
                outside = sum(1 for p in params if id(p) not in owned)
                if outside:
                    raise ValueError(f"gpuops.ZeroOptimizer: overlap_param_gather must be the module whose forward "
                                     f"reads the parameters; {outside} of the {len(params)} parameters are not its "
                                     "parameters")
        except Exception as error:  # noqa: BLE001 - raised below, after the other ranks heard of it
            _dist.fail_together(communicator, "ZeroOptimizer", error)
        shapes = [(p.shape, p.dtype) for p in params]
        self._impl = _C.ZeroOptimizer(params, communicator, stage, kind, dict(defaults), reduce_in_backward,
                                      bucket_bytes, names, True if module is not None else overlap_param_gather,
                                      unit_of, prefetch, reshard_after_forward, device, check_unit_order,
                                      "none" if offload is None else offload)
        self._hooks = _wait_hooks(self, module, params) if module is not None else []
        self.model = model
        self._sharded_names = sharded_names(model, params) if stage == 3 else {}
        self._params = params  # the model's, for the unsharded optimizer's load checks
        if stage == 3:
            model._gpuops_sharded_by = weakref.ref(self)  # its parameters live here (find_max_batch_size's restore=)
            self._hooks += install_unit_hooks(self, model, unit_order)
            self._hooks += install_layout_check(self, model, self._sharded_names, params)
            self._hooks += install_state_dict_hooks(self, model, self._sharded_names)
        # (stage 3: placeholders from here on; their shapes and dtypes, without bytes, stand in for the checks)
        self._checked_as = [torch.empty(s, dtype=d, device="meta", requires_grad=True) for s, d in shapes]
        self.param_names = names
        self.communicator = communicator
        self._consolidated: Optional[list] = None
        super().__init__(self._impl.shard_params(), self._impl.options)

    def add_param_group(self, param_group: dict) -> None:
        if self.param_groups:
            raise ValueError("gpuops.ZeroOptimizer: add_param_group is not supported (one group over the flat "
                             "buffers); make another ZeroOptimizer for parameters with other options")
        super().add_param_group(param_group)

    @property
    def stage(self) -> int:
        return self._impl.stage

    @property
    def kind(self) -> str:
        """'AdamW', 'Adam' or 'SGD'."""
        return self._impl.kind

    def step(self, closure: Optional[Callable[[], Any]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        from_ours, self._reduced_for_scaler = self._reduced_for_scaler, False
        if (grad_scale is not None or found_inf is not None) and not from_ours:
            self.__dict__.pop("grad_scale", None)  # torch's scaler removes them only after a step that returned
            self.__dict__.pop("found_inf", None)
            try:  # the other ranks' step reduces, then combines its overflow flag: they raise naming this cause
                self._impl.refuse_step_with_foreign_scaler()
            except Exception as lost:  # (a peer already gone: the timeout's error, kept as the cause)
                refused = lost
            else:
                refused = None
            raise TypeError("ZeroOptimizer.step: a GradScaler other than gpuops.GradScaler (torch.amp.GradScaler, or "
                            "one built on it) handed over its scale: it checked and unscaled this rank's shard of "
                            "the unreduced gradients only, so ranks would skip on different steps and unscale_() "
                            "would leave part of each gradient scaled. Use gpuops.GradScaler (the same API), which "
                            "reduces the gradients first and agrees on one overflow flag; nothing was stepped"
                            ) from refused
        self._sync_options()
        self._impl.step(grad_scale, found_inf)
        return loss

    def _sync_options(self) -> None:
        """The group's options as schedulers left them (lr; OneCycleLR/CyclicLR also betas or momentum) go to
        the C++ optimizer, checked there; keys it does not have (initial_lr, max_lr, ...) are the schedulers'."""
        current = self._impl.options
        group = self.param_groups[0]
        changed = {k: group[k] for k in current if k in group and group[k] != current[k]}
        if changed:
            self._impl.set_options(changed)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the gradients by their global L2 norm, over every rank's shard (FSDP's and DeepSpeed's
        ``clip_grad_norm_``); call it after backward (and after ``scaler.unscale_(opt)`` with a GradScaler),
        before ``step``. It reduces the gradients first. ``torch.nn.utils.clip_grad_norm_(model.parameters())``
        would see this rank's gradients only: ZeroOptimizer warns when it finds them changed. Returns the total
        norm (a tensor, as torch's). Collective."""
        if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or float(norm_type) != 2.0:
            raise ValueError(f"gpuops.ZeroOptimizer.clip_grad_norm_: norm_type must be 2 (the L2 norm), got "
                             f"{norm_type!r}")
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not 0 < max_norm < float("inf"):
            raise ValueError(f"gpuops.ZeroOptimizer.clip_grad_norm_: max_norm must be a number > 0, got {max_norm!r}")
        return clip_sharded_grad_norm_(self, float(max_norm))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the flat gradients (stage 2: allocates them again) for the next backward. As in torch, a
        parameter without a gradient is not stepped: with ``set_to_none`` (the default) every parameter counts as
        without one until a backward reaches it (on any rank: a parameter some ranks used gets the mean with the
        others' gradients as zeros, as in DDP); with ``set_to_none=False`` those that had one keep it (zeros)
        and are stepped. The ``.grad`` views themselves stay (they are the flat buffer's)."""
        if not isinstance(set_to_none, bool):
            raise TypeError(f"gpuops.ZeroOptimizer.zero_grad: set_to_none must be a bool, got {set_to_none!r}")
        self._impl.zero_grad(set_to_none)

    def full_state_dict(self, to: int = 0) -> Optional[dict]:
        """Stage 3: the model's full state_dict on rank ``to``'s host memory, its parameters gathered unit by unit
        (no device holds the whole model), which an unsharded model loads with ``load_state_dict``; None on the
        other ranks. Collective: every rank calls it."""
        return full_state_dict(self, self.model, self._sharded_names, to)

    def _local_snapshot(self) -> bytes:
        """This rank's shard (what save_shard writes), in memory: what find_max_batch_size(restore=) puts back.
        At stage 3 it holds the model's parameters too."""
        return self._impl.save_bytes()

    def _local_restore(self, saved: bytes) -> None:
        """Puts back a _local_snapshot(). Collective: every rank restores its own of the same snapshot."""
        self._impl.load_bytes(saved)
        self.param_groups[0].update(self._impl.options)

    def wait_for_parameters(self, params=None) -> None:
        """Waits for the all-gathers after the last step (``overlap_param_gather``) of the buckets holding
        ``params`` (all of them when None). Returns at once when nothing is pending."""
        self._impl.wait_for_parameters(None if params is None else list(params))

    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer state tensors (moments, step counters, fp32 masters)."""
        return self._impl.state_bytes()

    def gradient_bytes(self) -> int:
        """Bytes of the gradient buffers this rank holds now."""
        return self._impl.gradient_bytes()

    def flat_numels(self) -> list:
        """Elements of each flat buffer, padding included (every rank owns 1/world_size of each)."""
        return self._impl.flat_numels()

    # ------------------------------------------------------------------ state
    def save_shard(self, path) -> None:
        """Writes this rank's shard and layout to ``path`` (complete or absent)."""
        self._sync_options()
        self._impl.save_shard(str(path))

    def load_shards(self, files, allow_reshard: bool = False) -> None:
        """Loads the shard files of every rank of the saving job (``files[r]``: rank r's); when the world size
        differs, each rank cuts its new shard out of them (exact), if ``allow_reshard``. Collective: all or nothing
        on every rank (files of several saves, or a failure on any rank, change no rank's state)."""
        try:
            if isinstance(files, (str, bytes, os.PathLike)) or not hasattr(files, "__iter__"):
                raise TypeError("gpuops.ZeroOptimizer.load_shards: files must be a list of paths, one per rank of the "
                                f"saving job in rank order, got {type(files).__name__} {files!r}")
            if not isinstance(allow_reshard, bool):
                raise TypeError(f"gpuops.ZeroOptimizer.load_shards: allow_reshard must be a bool, got {allow_reshard!r}")
            paths = [os.fsdecode(f) for f in files]
            for path in paths:
                path.encode("utf-8")  # a path C++ can take (a surrogate from undecodable bytes cannot cross)
        except Exception as error:  # noqa: BLE001 - raised after the other ranks heard of it
            _dist.fail_together(self.communicator, "ZeroOptimizer.load_shards", error)
        self._impl.load_shards(paths, allow_reshard)
        self.param_groups[0].update(self._impl.options)

    def offload_timeline(self) -> list:
        """offload='cpu': the last step's timeline, one ``(what, bucket, begin_s, end_s)`` per gradient copy to
        the host, host step and parameter copy back, in seconds since the window began (zero_grad(), or the
        reduction at the step)."""
        return self._impl.offload_timeline()

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gathers the full state on rank ``to``'s host memory, chunk by chunk (no device holds it whole).
        Collective: every rank calls it."""
        try:
            self._sync_options()
        except Exception as error:  # noqa: BLE001 - raised after the other ranks heard of it
            _dist.fail_together(self.communicator, "ZeroOptimizer.consolidate_state_dict", error)
        per_param = self._impl.consolidate_state(to)
        self._consolidated = per_param if self._impl.rank == to else None

    def state_dict(self) -> dict:
        """The full state dict gathered by consolidate_state_dict, on its rank ``to``: torch.optim's format
        (``state`` by parameter index in the order given, one group), which torch's optimizer of the same kind
        loads."""
        if self._consolidated is None:
            raise RuntimeError("gpuops.ZeroOptimizer.state_dict: call consolidate_state_dict(to) on every rank "
                               "first; the full state is then returned on rank `to` (as torch's "
                               "ZeroRedundancyOptimizer)")
        group = dict(self._impl.options)
        group.update({k: v for k, v in self.param_groups[0].items() if k not in ("params",)})
        group["params"] = list(range(self._impl.param_count))
        if self.param_names:
            group["param_names"] = list(self.param_names)  # torch's state_dict of named parameters
        state = {i: dict(s) for i, s in enumerate(self._consolidated) if s}
        for entry in state.values():
            if "exp_avg_codes" in entry:  # 8-bit moments: the code books they were written with
                entry["state_format"] = _C.STATE_FORMAT
        return {"state": state, "param_groups": [group]}

    def dequantized_state_dict(self) -> dict:
        """state_dict() in torch's form: 8-bit moments (state_bits=8) decoded into float32 ``exp_avg`` and
        ``exp_avg_sq``, which torch.optim's optimizer of this kind loads. After consolidate_state_dict, on its rank
        ``to``."""
        from .optim import _decoded_entry

        saved = self.state_dict()
        saved["state"] = {key: _decoded_entry(entry) for key, entry in saved["state"].items()}
        return saved

    def load_state_dict(self, state_dict: dict) -> None:
        """A full state dict (state_dict()'s, or torch's optimizer of the same kind over the same parameters in
        the same order): every rank keeps its shard. The group's lr is taken; its other options are not.
        Checked as the unsharded optimizer of this kind checks it (gpuops.optim's load_state_dict), then agreed:
        collective, all or nothing on every rank (a rank whose state dict fails its checks, or differs from the
        others', makes every rank raise with nothing changed)."""
        where = "gpuops.ZeroOptimizer.load_state_dict"
        try:
            checker = self._unsharded_checker(state_dict)
            checker._checked_id_map(state_dict, where)
            ids = [i for g in state_dict["param_groups"] for i in g["params"]]
            saved = state_dict["state"]
            per_param = [{k: torch.as_tensor(v, dtype=torch.float32).reshape(()) if k == "step" else v
                          for k, v in saved.get(i, {}).items() if k == "step" or isinstance(v, torch.Tensor)}
                         for i in ids]
            for i, entry in zip(ids, per_param):  # what C++ takes: names as str
                bad = next((k for k in entry if not isinstance(k, str)), None)
                if bad is not None:
                    raise ValueError(f"{where}: state[{i!r}] has the key {bad!r}; state keys are names (str)")
            lrs = {float(g["lr"]) for g in state_dict["param_groups"] if "lr" in g}  # checked above
        except Exception as error:  # noqa: BLE001 - raised after the other ranks heard of it
            _dist.fail_together(self.communicator, "ZeroOptimizer.load_state_dict", error)
        lr = lrs.pop() if len(lrs) == 1 else None
        # Ranks loading different learning rates would train on a mix: agreed before anything changes.
        self.communicator.agree("ZeroOptimizer.load_state_dict", fields=[("lr", repr(lr))])
        self._impl.load_full_state(per_param)
        if lr is not None:
            self.param_groups[0]["lr"] = lr

    def _unsharded_checker(self, state_dict):
        """gpuops.optim's optimizer of this kind over the same parameters, grouped as ``state_dict``'s groups (one
        group when they do not add up): whose load_state_dict checks are the ones this load applies."""
        from . import optim as unsharded

        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        sizes = [len(g["params"]) for g in groups if isinstance(g, dict) and isinstance(g.get("params"), (list, tuple))
                 ] if isinstance(groups, (list, tuple)) else []
        if not sizes or len(sizes) != len(groups) or sum(sizes) != len(self._checked_as):
            sizes = [len(self._checked_as)]
        split, start = [], 0
        for n in sizes:
            split.append({"params": self._checked_as[start:start + n]})
            start += n
        return getattr(unsharded, self.kind)(split, **self._impl.options)

    # GradScaler's hooks for sharded optimizers: reduce before the gradients are read; one flag, one norm.
    # _reduced_for_scaler: our GradScaler combined its overflow flag over ranks since the last step (it does on
    # every path), so a scale handed to step() is one it checked on the reduced gradients; torch's never does.
    def _gpuops_prepare_gradients(self) -> None:  # (clip_grad_norm_ calls it too: not a scaler's mark)
        self._impl.prepare_gradients()

    def _gpuops_global_found_inf(self, found_inf: torch.Tensor) -> torch.Tensor:
        self._reduced_for_scaler = True
        return self._impl.global_found_inf(found_inf)

    def _gpuops_global_grad_norm(self, norm: torch.Tensor) -> torch.Tensor:
        return self._impl.global_grad_norm(norm)

    def _gpuops_global_divisor(self, divisor: torch.Tensor) -> torch.Tensor:
        return self._impl.global_divisor(divisor)


__all__ = ["ZeroOptimizer"]
