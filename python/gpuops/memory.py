"""Memory budgets: count what a block allocates and make it fail past a limit, as a GPU would."""

from __future__ import annotations

from typing import Optional, Union

import torch

from . import _C


def memory_budget(limit_bytes: Optional[int] = None, device: Union[str, torch.device] = "cpu") -> _C.MemoryBudget:
    """A context manager that counts the bytes allocated inside it.

    Past ``limit_bytes`` an allocation raises ``torch.OutOfMemoryError``, wherever it happens
    (forward, backward, optimizer step). On the CPU it counts through a counting allocator put in
    front of c10's; on CUDA it reads the caching allocator and caps it with a memory fraction.
    The previous allocator (or fraction) is restored on exit, also when an exception unwinds.

    >>> with gpuops.memory_budget(1 << 30) as mb:
    ...     loss = model(x).sum(); loss.backward()
    >>> mb.peak_bytes
    """
    return _C.MemoryBudget(limit_bytes, str(device))
