"""OOM-safe batch-size search and the profiled memory estimator, over the C++ engine.

    result = gpuops.find_max_batch_size(lambda b: train_step(b), restore=[model, optimizer])
    result.max_batch, result.recommended, result.trials

A trial is real: ``steps_per_trial`` full training steps (a warm-up step plus one more by default: optimizer
state is allocated on the first) and the validation function if given. An out-of-memory error, recognised by
type (``torch.OutOfMemoryError``; cuBLAS/cuDNN allocation failures on CUDA) wherever it is raised, marks
the trial failed: the exception and its frames are dropped, cached memory is released and peak statistics
reset. Any other exception propagates unchanged. By default two small profiling trials seed the search,
which then goes, trial by trial, to the batch that a fit of the measured peaks says fills the memory, and
confirms the exact largest batch; ``seed=None`` probes exponentially from ``low`` and bisects instead;
``seed=<int>`` or ``seed=<MemoryProfile>`` (``profile_memory``, or ``analytic_profile`` of an estimate)
gallops from the batch it predicts.
"""

from __future__ import annotations

import gc
import hashlib
import os
import time
import traceback
import warnings
from typing import Callable, Iterable, Optional, Sequence, Union

import torch

from . import _C
from ._snapshot import StateSnapshot
from .memory import memory_budget

MemoryProfile = _C.MemoryProfile
BatchSearchResult = _C.BatchSearchResult
BatchTrial = _C.BatchTrial


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an out-of-memory failure: torch.OutOfMemoryError (the type c10 raises, also under
    gpuops.memory_budget), or a cuBLAS/cuDNN workspace allocation failure (a RuntimeError with their status)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(
        status in str(error) for status in ("CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED"))


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _device(where: str, device) -> torch.device:
    """device as a torch.device (the default device for None); ValueError naming it otherwise."""
    if device is None:
        return _default_device()
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{where}: device must be a torch.device or a str such as 'cuda:0' or 'cpu', got "
                         f"{device!r}") from None


def _headroom(device: torch.device) -> int:
    """CPU: the tightest active memory_budget (-1 without one); CUDA: free memory plus the allocator's unused
    cache, within its memory fraction (a memory_budget cap)."""
    return _C.memory_headroom_bytes(str(device))


def _trial_runner(step_fn: Callable[[int], object], validate: Optional[Callable[[int], object]], steps: int,
                  counter):
    """Runs trials measured by `counter`, a memory_budget spanning the whole search: peaks count from the
    search's start, so memory a trial leaves behind (optimizer state made by the first step) counts in every
    later trial and the fitted law peak(b) holds across trials."""
    device = torch.device(counter.device)

    def run(batch: int):
        ok = True
        counter.reset_peak()
        start = time.perf_counter()
        try:
            for i in range(steps):
                if i == steps - 1:
                    counter._start_trace()  # the last step's allocations: earlier steps may still create state
                step_fn(batch)
            if validate is not None:
                validate(batch)
        except BaseException as error:  # noqa: BLE001 - only OOM is swallowed, the rest re-raised
            counter._take_trace()
            if not is_out_of_memory(error):
                raise
            ok = False
            traceback.clear_frames(error.__traceback__)  # the frames hold the trial's activations
        seconds = time.perf_counter() - start
        peak = counter.peak_bytes
        trace = counter._take_trace() if ok else []
        if not ok:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        return ok, peak, seconds, trace

    return run


def _agreement(process_group, device: torch.device):
    if process_group is None:
        return None
    import torch.distributed as dist

    on = device if dist.get_backend(process_group) == "nccl" else torch.device("cpu")

    def agree_min(value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=on)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=process_group)
        return int(t.item())

    return agree_min


def model_signature(model: torch.nn.Module) -> str:
    """A short hash of a model's parameter and buffer names, shapes and dtypes (for cache keys)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model_signature: model must be a torch.nn.Module, got {type(model).__name__}")
    digest = hashlib.sha256()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return digest.hexdigest()[:16]


def cache_key(*, model: Optional[torch.nn.Module] = None, dtype=None, sequence_length: Optional[int] = None,
              device: Optional[torch.device] = None, extra: str = "") -> str:
    """The cache key (GPU model, model signature, dtype, sequence length); on the CPU the active budget's
    headroom stands for the GPU model."""
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"cache_key: model must be a torch.nn.Module or None, got {type(model).__name__}")
    if sequence_length is not None and (isinstance(sequence_length, bool) or not isinstance(sequence_length, int)):
        raise TypeError(f"cache_key: sequence_length must be an int or None, got {sequence_length!r}")
    if not isinstance(extra, str):
        raise TypeError(f"cache_key: extra must be a str, got {extra!r}")
    device = _device("cache_key", device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu-{_headroom(device)}B"
    parts = [where, model_signature(model) if model is not None else "-", str(dtype), str(sequence_length), extra]
    return "|".join(parts)


def analytic_profile(breakdown, micro_batch: int) -> MemoryProfile:
    """A memory profile from the analytic estimator: ``gpuops.estimate(..., micro_batch=b)``'s activations,
    logits and temporaries grow with the batch, the rest is fixed. Pass it as ``seed=`` to start the search
    where the estimate says the memory fills up (the CUDA context and allocator slack count as fixed)."""
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
        raise ValueError(f"analytic_profile: micro_batch must be an int >= 1, got {micro_batch!r}")
    if not all(hasattr(breakdown, k) for k in ("activations", "logits", "temporaries", "total_bytes")):
        raise TypeError(f"analytic_profile: breakdown must be what gpuops.estimate() returns, got "
                        f"{type(breakdown).__name__}")
    per_batch = breakdown.activations + breakdown.logits + breakdown.temporaries
    fixed = breakdown.total_bytes - per_batch
    per_sample = per_batch / micro_batch
    return _C.fit_memory_profile([(1, round(fixed + per_sample)), (2, round(fixed + 2 * per_sample))])


def _check_int(name: str, value, minimum: int) -> None:
    """None, or an int in [minimum, 2**63 - 1] (pybind would raise a TypeError listing the whole signature)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value < 2**63:
        raise ValueError(f"find_max_batch_size: {name} must be an int in [{minimum}, 2**63 - 1], got {value!r}")


def find_max_batch_size(step_fn: Callable[[int], object], *, low: int = 1, high: Optional[int] = None,
                        seed: Union[str, int, MemoryProfile, None] = "profile", margin: float = 0.0,
                        multiple_of: int = 1, steps_per_trial: int = 2,
                        validate: Optional[Callable[[int], object]] = None, max_trials: Optional[int] = None,
                        max_seconds: Optional[float] = None, cache_file: Optional[str] = None,
                        cache_key: Optional[str] = None, restore: Iterable = (), process_group=None,
                        device: Union[str, torch.device, None] = None,
                        headroom_bytes: Optional[int] = None, verbose: bool = True) -> BatchSearchResult:
    """The largest batch size ``step_fn(batch)`` runs at without running out of memory.

    ``high``: the largest batch tried; by default the memory the trials may use in bytes (a batch of b samples
    takes at least b bytes), and a step that still runs there is reported (ValueError: its memory does not
    grow with the batch) rather than probed forever.
    ``restore``: objects with state_dict/load_state_dict (model, optimizer, scaler) put back as they were
    after the search (the trials train them), modules' gradients included; their snapshot lives in host memory
    and is put back outside any budget, also when the search fails (its error is the one raised). A
    gpuops.ZeroOptimizer puts back each rank's shard (every rank restores: run the search on every rank); a
    stage-3 model needs its optimizer in the list, which holds its parameters.
    ``process_group``: a torch.distributed group; every trial's outcome is agreed (the minimum) before the
    next, so all ranks return the same result. ``headroom_bytes``: the memory the trials may use, for the
    profile seed (default: the active memory_budget on the CPU, free memory on CUDA). On the CPU without an
    active memory_budget the trials run under one of 90% of the memory available now, with a warning (nothing
    else would stop them before the kernel's OOM killer). ``verbose``: one line per trial on stderr.
    Returns max_batch, recommended (after ``margin`` and ``multiple_of``), trials (batch, ok, peak_bytes,
    seconds, phase), the memory profile used, and whether it came from ``cache_file``.
    """
    if not callable(step_fn):
        raise ValueError(f"find_max_batch_size: step_fn must be callable, got {type(step_fn).__name__}")
    if validate is not None and not callable(validate):
        raise ValueError("find_max_batch_size: validate must be callable or None")
    if isinstance(seed, bool) or not (seed is None or isinstance(seed, (int, MemoryProfile)) or seed == "profile"):
        raise ValueError(f"find_max_batch_size: seed must be 'profile', an int, a MemoryProfile or None, got {seed!r}")
    for name, value, minimum in (("low", low, 1), ("high", high, 1), ("multiple_of", multiple_of, 1),
                                 ("steps_per_trial", steps_per_trial, 1), ("max_trials", max_trials, 0),
                                 ("headroom_bytes", headroom_bytes, -1)):
        _check_int(name, value, minimum)
    if isinstance(seed, int) and not isinstance(seed, bool):
        _check_int("seed", seed, 1)
    for name, value in (("margin", margin), ("max_seconds", max_seconds)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"find_max_batch_size: {name} must be a number, got {value!r}")
    if cache_file is not None and not isinstance(cache_file, (str, os.PathLike)):
        raise ValueError(f"find_max_batch_size: cache_file must be a path, got {cache_file!r}")
    if cache_key is not None and not isinstance(cache_key, str):
        raise ValueError(f"find_max_batch_size: cache_key must be a str, got {cache_key!r}")
    if not isinstance(verbose, bool):
        raise ValueError(f"find_max_batch_size: verbose must be True or False, got {verbose!r}")
    device = _device("find_max_batch_size", device)
    limit = _C.default_search_limit(str(device))  # gpuops::default_search_limit: one rule for C++ and Python
    if limit > 0:
        warnings.warn(f"find_max_batch_size: no memory budget is active on the CPU, so the trials may use "
                      f"{limit / 2**30:.1f} GiB (90% of the memory available now); give one with "
                      "gpuops.memory_budget(bytes) to stand for a GPU", stacklevel=2)
    options = _C.BatchSearchOptions()
    options.verbose = verbose
    options.low, options.high, options.multiple_of, options.margin = low, high, multiple_of, margin
    options.steps_per_trial = steps_per_trial
    options.max_trials = 0 if max_trials is None else max_trials
    options.max_seconds = 0.0 if max_seconds is None else max_seconds
    options.headroom_bytes = (limit if limit > 0 else _headroom(device)) if headroom_bytes is None else headroom_bytes
    options.profile_seed = seed == "profile"
    if isinstance(seed, MemoryProfile):
        options.seed = max(1, seed.max_batch_for(options.headroom_bytes))
    elif isinstance(seed, int):
        options.seed = seed
    if cache_file is not None:
        options.cache_file = os.fspath(cache_file)
        options.cache_key = cache_key if cache_key is not None else ""
    restore = list(restore)
    for i, o in enumerate(restore):  # a stage-3 model alone would be "restored" without its parameters
        holder = getattr(o, "_gpuops_sharded_by", None)
        if holder is not None and holder() is not None and not any(r is holder() for r in restore):
            raise ValueError(f"find_max_batch_size: restore[{i}] is a model whose parameters a stage-3 "
                             "gpuops.ZeroOptimizer holds: put that optimizer in restore= too (each rank puts its "
                             "shard back)")
    snapshot = StateSnapshot(restore) if restore else None
    try:
        with memory_budget(limit if limit > 0 else None, device) as counter:
            result = _C.search_max_batch(_trial_runner(step_fn, validate, steps_per_trial, counter), options,
                                         _agreement(process_group, device))
    except BaseException as error:
        if snapshot is not None:  # put the objects back, but the search's own error is the one raised
            try:
                snapshot.restore()
            except Exception as restore_error:  # noqa: BLE001
                error.add_note(f"find_max_batch_size: restore= also failed: {type(restore_error).__name__}: "
                               f"{restore_error}")
        raise
    if snapshot is not None:
        snapshot.restore()
    return result


def profile_memory(step_fn: Callable[[int], object], batch_sizes: Sequence[int] = (1, 2), *,
                   steps_per_trial: int = 2, tolerance: float = 0.05,
                   device: Union[str, torch.device, None] = None) -> MemoryProfile:
    """Runs real steps at ``batch_sizes`` and fits peak(b) = fixed + per_sample * b; ``predict(b)`` and
    ``max_batch_for(bytes)`` then answer for any batch. With a third batch size the fit is checked: when
    memory is not linear in the batch (the point is off by more than ``tolerance``), ``linear`` is False,
    ``note`` says where, and a warning is issued."""
    if not callable(step_fn):
        raise ValueError(f"profile_memory: step_fn must be callable, got {type(step_fn).__name__}")
    if isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Iterable):
        raise ValueError(f"profile_memory: batch_sizes must be a sequence of ints, got {batch_sizes!r:.80}")
    batch_sizes = tuple(batch_sizes)  # (a generator is read once)
    if len(batch_sizes) < 2 or any(isinstance(b, bool) or not isinstance(b, int) or not 1 <= b < 2**63
                                   for b in batch_sizes):
        raise ValueError(f"profile_memory: batch_sizes must hold at least two ints in [1, 2**63 - 1], got "
                         f"{batch_sizes}")
    if isinstance(steps_per_trial, bool) or not isinstance(steps_per_trial, int) or steps_per_trial < 1:
        raise ValueError(f"profile_memory: steps_per_trial must be an int >= 1, got {steps_per_trial!r}")
    device = _device("profile_memory", device)
    points = []
    for batch in batch_sizes:
        with memory_budget(None, device) as counter:  # each point measured from the same starting state
            ok, peak, _, _ = _trial_runner(step_fn, None, steps_per_trial, counter)(batch)
        if not ok:
            raise torch.OutOfMemoryError(f"profile_memory: batch {batch} runs out of memory; profile smaller "
                                         "batch sizes")
        points.append((batch, peak))
    profile = _C.fit_memory_profile(points, tolerance)
    if not profile.linear:
        warnings.warn(f"profile_memory: {profile.note}")
    return profile
