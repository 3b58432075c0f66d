"""Runs a benchmark's ranks as local processes over Gloo (one per rank, on a free port) and hands back what
rank 0 printed on its "ROWS <json>" line; used by zero_comparison.py, train_compare.py and
estimator_validation/zero_ranks.py. Also wraps torch.distributed.broadcast to count its bytes (torch's
ZeroRedundancyOptimizer sends each rank's updated partition that way, outside any comm hook)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys


def launch(script: str, world: int, env: dict, timeout: float, threads: str = "1") -> list:
    """Starts `script` as `world` ranks (RANK, WORLD_SIZE, MASTER_ADDR/PORT and `env` set; OMP_NUM_THREADS
    `threads`); raises RuntimeError with every failed rank's output tail when one fails."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                OMP_NUM_THREADS=threads, **env)
    procs = [subprocess.Popen([sys.executable, os.path.abspath(script)], env=dict(base, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    failed = [f"rank {r} of {world} failed (exit {p.returncode}):\n{out[-4000:]}"
              for r, (p, out) in enumerate(zip(procs, outs)) if p.returncode != 0]
    if failed:
        raise RuntimeError("\n".join(failed))
    return json.loads(next(line for line in outs[0].splitlines() if line.startswith("ROWS "))[5:])


def print_rows(rows: list) -> None:
    """Rank 0's answer to launch()."""
    print("ROWS " + json.dumps(rows), flush=True)


class BroadcastCounter:
    """While `counting` is True, torch.distributed.broadcast adds each tensor's ring share, (N-1)/N of its
    bytes, to `bytes`. restore() puts the original back."""

    def __init__(self, world: int) -> None:
        import torch.distributed as dist

        self.bytes, self.counting, self._original = 0, False, dist.broadcast

        def counting_broadcast(tensor, *args, **kwargs):
            if self.counting:
                self.bytes += tensor.nbytes * (world - 1) // world
            return self._original(tensor, *args, **kwargs)

        dist.broadcast = counting_broadcast

    def restore(self) -> None:
        import torch.distributed as dist

        dist.broadcast = self._original
