"""The communicator (issue 13, part 1): reduce-scatter, all-gather, all-reduce and barrier over a
torch.distributed process group, in place on flat buffers, each returning a handle to wait on.

    import torch.distributed as dist, gpuops
    dist.init_process_group("gloo")                 # torchrun, or any launcher
    comm = gpuops.dist.Communicator()               # the default group; timeout=300 s per collective
    work = comm.reduce_scatter(flat_grads, "avg")   # this rank's shard of the average: comm.shard(flat_grads)
    ...                                             # compute meanwhile
    work.wait()

The C++ library does the work (``gpuops::dist::Communicator``); the group reaches it as the
``c10d::ProcessGroup`` torch itself holds. Every collective fails after ``timeout`` seconds (a peer that died
or stalled) with a RuntimeError naming the collective and this rank, instead of waiting for the group's own
timeout (30 minutes by default).
"""

from __future__ import annotations

from typing import Optional

from . import _C

CommWork = _C.CommWork


class Communicator(_C.Communicator):
    """Collectives over ``group`` (a torch.distributed ProcessGroup; None: the default group)."""

    def __init__(self, group=None, timeout: float = 300.0):
        import torch.distributed as _dist

        if group is not None and not isinstance(group, _dist.ProcessGroup):
            raise TypeError("gpuops.dist.Communicator: group must be a torch.distributed ProcessGroup or None (the "
                            f"default group), got {type(group).__name__} {group!r}")
        if group is None:
            import torch.distributed as _dist

            if not (_dist.is_available() and _dist.is_initialized()):
                raise RuntimeError(
                    "gpuops.dist.Communicator: group=None needs torch.distributed's default group: "
                    "call torch.distributed.init_process_group first, or pass a group"
                )
            group = _dist.distributed_c10d._get_default_group()
        super().__init__(group, timeout)


def one_rank_group(timeout: float = 300.0):
    """A Gloo process group of this process alone (no default group, no rendezvous): a single-process
    ZeroOptimizer's. Gloo runs on CPU and CUDA tensors alike."""
    import datetime

    import torch
    import torch.distributed as _dist

    store = _dist.HashStore()
    group = _dist.ProcessGroup(store, 0, 1)
    gloo = _dist.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=timeout))
    # How torch's own init_process_group wires a backend into a group (private API of the pinned torch 2.11).
    group._set_default_backend(_dist.ProcessGroup.BackendType.GLOO)
    for device in ("cpu", "cuda"):
        group._register_backend(torch.device(device), _dist.ProcessGroup.BackendType.GLOO, gloo)
    return group


def fail_together(communicator: _C.Communicator, what: str, error: BaseException) -> None:
    """Raises ``error`` after telling every rank, waiting in ``what``'s agreement (gpuops/agreement.h), that this
    rank failed with it: they raise ValueError naming this rank and the error within seconds, instead of waiting
    for a collective this rank will never join."""
    try:
        communicator.agree(what, error_line(error))
    except Exception:  # noqa: BLE001 - our own failure comes back from the exchange; error is what to raise
        pass
    raise error


def error_line(error: Optional[BaseException]) -> str:
    """An exception as one line of valid UTF-8 for the other ranks ("" for None): its type and first line."""
    if error is None:
        return ""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")  # a lone surrogate would stop the exchange


def from_environment(timeout: float = 300.0, rendezvous_timeout: Optional[float] = None) -> _C.Communicator:
    """A communicator built in C++ from the launcher's variables (torchrun's RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT, or srun's SLURM_PROCID, SLURM_NTASKS with MASTER_ADDR, MASTER_PORT): Gloo, CPU tensors.
    ``timeout``: each collective's, seconds; ``rendezvous_timeout``: how long every rank waits for the others to
    arrive (default: ``timeout``)."""
    return _C.Communicator.from_environment(timeout, timeout if rendezvous_timeout is None else rendezvous_timeout)


__all__ = ["CommWork", "Communicator", "fail_together", "from_environment"]
