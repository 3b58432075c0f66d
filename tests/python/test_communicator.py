"""gpuops.dist.Communicator over a torch.distributed Gloo group: two real processes (this file run as a
script, one per rank), each checking that our collectives give what torch.distributed's own give on the
same inputs, bit for bit; a peer SIGKILLed makes the survivor raise naming the collective, well within the
timeout. Each test is bounded (25 s)."""

import os
import signal
import sys
import time

import pytest
import torch

import gpuops
from multiprocess_launch import launch

WORLD = 2
DEADLINE_S = 25


def _launch(scenario, world=WORLD):
    return launch(__file__, scenario, world, DEADLINE_S)


def test_matches_torch_distributed():
    for rank, (code, out) in enumerate(_launch("compare")):
        assert code == 0, f"rank {rank}:\n{out}"
        assert "compare ok" in out


def test_killed_peer_raises_within_timeout():
    (code0, out0), (code1, _) = _launch("killed")
    assert code1 == -signal.SIGKILL
    assert code0 == 0, out0
    assert "all_reduce(sum)" in out0 and "rank 0 of 2" in out0, out0


def test_group_none_needs_init():
    if torch.distributed.is_initialized():
        pytest.skip("a default group exists in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        gpuops.dist.Communicator()


def test_from_environment_names_missing_variable(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ValueError, match="MASTER_PORT is not set"):
        gpuops.dist.from_environment()
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match="RANK=1 must be below WORLD_SIZE=1"):
        gpuops.dist.from_environment()


# ---------------------------------------------------------------------------------------------------------
# The ranks (this file run as a script)


def _inputs(rank, numel, salt):
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(numel, generator=g)


def _compare(dist, comm, group):
    r, n = comm.rank, comm.size
    assert (r, n) == (dist.get_rank(group), dist.get_world_size(group))
    S = 1031
    N = S * n
    # reduce_scatter: torch's reduce_scatter_tensor (Gloo has no AVG: sum / n, as ours)
    for op in ("sum", "avg"):
        ours = _inputs(r, N, 1)
        theirs = torch.empty(S)
        dist.reduce_scatter_tensor(theirs, ours.clone(), op=dist.ReduceOp.SUM, group=group)
        if op == "avg":
            theirs /= n
        comm.reduce_scatter(ours, op).wait()
        assert torch.equal(comm.shard(ours), theirs), op
        assert torch.equal(ours[r * S:(r + 1) * S], theirs)
    # all_gather
    buf = torch.full((N,), float("nan"))
    buf[r * S:(r + 1) * S] = _inputs(r, S, 2)
    theirs = torch.empty(N)
    dist.all_gather_into_tensor(theirs, _inputs(r, S, 2), group=group)
    comm.all_gather(buf).wait()
    assert torch.equal(buf, theirs)
    # all_reduce
    for op, top in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN), ("avg", None)):
        ours = _inputs(r, 4096, 3)
        theirs = ours.clone()
        dist.all_reduce(theirs, op=top or dist.ReduceOp.SUM, group=group)
        if op == "avg":
            theirs /= n
        comm.all_reduce(ours, op).wait()
        assert torch.equal(ours, theirs), op
    # two in flight, waited in order
    a, b = _inputs(r, N, 4), _inputs(r, N, 5)
    ta, tb = a.clone(), torch.empty(S)
    wa, wb = comm.all_reduce(a), comm.reduce_scatter(b, "avg")
    x = torch.ones(64, 64)
    for _ in range(10):
        x = x @ x / 64
    wa.wait()
    wb.wait()
    assert wa.is_completed() and wb.is_completed() and wb.name == "reduce_scatter(avg)"
    dist.all_reduce(ta, group=group)
    dist.reduce_scatter_tensor(tb, _inputs(r, N, 5), group=group)
    assert torch.equal(a, ta) and torch.equal(comm.shard(b), tb / n)
    comm.barrier().wait()
    # bad input: clear errors, buffer untouched, nothing launched (the next collective still agrees)
    odd = torch.arange(2 * n + 1, dtype=torch.float32)
    with pytest.raises(ValueError, match=f"buffer's numel {2 * n + 1} is not divisible by the communicator's size {n}"):
        comm.reduce_scatter(odd)
    with pytest.raises(ValueError, match="contiguous"):
        comm.all_reduce(torch.zeros(4, 2 * n).t())
    with pytest.raises(ValueError, match="op must be one of"):
        comm.all_reduce(torch.zeros(4), "mean")
    with pytest.raises(TypeError, match="buffer must be a torch.Tensor"):
        comm.all_reduce([1.0, 2.0])
    assert torch.equal(odd, torch.arange(2 * n + 1, dtype=torch.float32))
    one = torch.ones(3)
    comm.all_reduce(one).wait()
    assert torch.equal(one, torch.full((3,), float(n)))


def _rank_main(scenario):
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    if scenario == "compare":
        _compare(dist, gpuops.dist.Communicator(timeout=10), None)
        group = dist.new_group([0, 1])
        _compare(dist, gpuops.dist.Communicator(group, timeout=10), group)
        print("compare ok", flush=True)
    elif scenario == "killed":
        comm = gpuops.dist.Communicator(timeout=5)
        comm.barrier().wait()
        if comm.rank == 1:
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            comm.all_reduce(torch.ones(1 << 16)).wait()
        except RuntimeError as e:
            elapsed = time.monotonic() - start
            print(f"raised after {elapsed:.3f} s (timeout 5 s): {e}", flush=True)
            assert elapsed < 5 + 2
            os._exit(0)  # the group is broken: skip torch.distributed's teardown
        os._exit(1)
    # Tear the groups down with both ranks still there, our communicators gone first (test_zero_optimizer.py).
    import gc

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(sys.argv[1])
