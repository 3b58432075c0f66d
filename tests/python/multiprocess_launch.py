"""Launch helper shared by the multi-process tests (test_communicator.py, test_zero_optimizer.py): runs a
script once per rank with torchrun-style variables (MASTER_ADDR=127.0.0.1, a free MASTER_PORT, RANK,
WORLD_SIZE, OMP_NUM_THREADS=1) and returns each rank's (returncode, output), failing the test past a deadline;
and the rank's side of a Gloo group (run_gloo_rank)."""

import os
import socket
import subprocess
import sys
import time

import pytest


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script, scenario, world, deadline_s, env=None, args=()):
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
                OMP_NUM_THREADS="1", **(env or {}))
    procs = []
    for rank in range(world):
        procs.append(subprocess.Popen([sys.executable, script, scenario, *args], env=dict(base, RANK=str(rank)),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs, deadline = [], time.monotonic() + deadline_s
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{scenario}: ranks still running after {deadline_s} s")
        outputs.append((p.returncode, out))
    return outputs


def run_gloo_rank(run, scenario, timeout_s=30):
    """A rank's side: joins the Gloo group, calls run(scenario, torch.distributed), then tears the group down."""
    import datetime
    import gc

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    run(scenario, dist)
    # Our communicators and optimizers hold the group: drop them first, so that the group is torn down inside
    # destroy_process_group with every rank still there (destroyed later, at the end of this process, after a
    # peer had left, Gloo's teardown sometimes hung).
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def expect_ok(script, scenario, world, deadline_s, directory=None):
    """Runs `scenario` on `world` ranks (GPUOPS_TEST_DIR=directory when given): each must exit 0 printing
    '<scenario> ok'; their outputs are printed (pytest -s shows the figures)."""
    env = {"GPUOPS_TEST_DIR": str(directory)} if directory else None
    for rank, (code, out) in enumerate(launch(script, scenario, world, deadline_s, env=env)):
        assert code == 0, f"rank {rank}:\n{out}"
        assert f"{scenario} ok" in out, out
        print(out)
