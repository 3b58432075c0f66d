"""gpuops.ZeroOptimizer(overlap_param_gather=model): the all-gathers after each step overlap the next forward,
waited per submodule by forward pre-hooks. Two real processes over Gloo (multiprocess_launch.py). Training with
the overlap gives the same bits as without it (stages 1 and 2, reduced at the step or in the backward, fp32 and
bf16 with fp32 masters, several buckets, a submodule the forward never calls, GradScaler, clipping and
accumulation); right after a step whose peer is late the parameters are provably not gathered yet, and the
model's state_dict pre-hook and TrainingState wait for them; bad input raises naming the argument."""

import sys

import pytest
import torch

import gpuops
from multiprocess_launch import launch

WORLD = 2
DEADLINE_S = 90
STEPS = 30


@pytest.mark.parametrize("scenario", ["same_bits", "checkpoint", "deferred", "bad_input"])
def test_overlap(scenario):
    for rank, (code, out) in enumerate(launch(__file__, scenario, WORLD, DEADLINE_S)):
        assert code == 0, f"rank {rank}:\n{out}"
        assert f"{scenario} ok" in out, out
        print(out)


# ----------------------------------------------------------------------------------------------------- ranks
class Net(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(4321)
        self.body = torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.Tanh(), torch.nn.Linear(31, 17),
                                        torch.nn.Tanh(), torch.nn.Linear(17, 5)).to(dtype)
        self.unused = torch.nn.Linear(7, 3).to(dtype)  # never called: its bucket is waited before the backward

    def forward(self, x):
        return self.body(x.to(self.body[0].weight.dtype)).float()


def _batch(step, micro, rank):
    g = torch.Generator().manual_seed(7000 + 100 * step + 10 * micro + rank)
    return torch.randn(6, 13, generator=g), torch.randn(6, 5, generator=g)


def _train(rank, dtype, overlap, **zero):
    model = Net(dtype)
    opt = gpuops.ZeroOptimizer(model.parameters(), lr=2e-2, weight_decay=0.05, bucket_bytes=512,
                               overlap_param_gather=model if overlap else False, **zero)
    scaler = gpuops.GradScaler("cpu", init_scale=256.0, growth_interval=5)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(2):
            x, y = _batch(step, m, rank)
            loss = torch.nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            losses.append(loss.item())
        scaler.set_grad_divisor(opt, 2)
        scaler.clip_grad_norm_(opt, 0.5)
        scaler.step(opt)
        scaler.update()
    opt.wait_for_parameters()
    return [p.detach().clone() for p in model.parameters()], losses, opt


def _full_state(opt):
    """The full optimizer state on every rank (consolidated on rank 0, then broadcast)."""
    opt.consolidate_state_dict(0)
    box = [opt.state_dict() if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _rank_main(scenario):
    import datetime
    import gc

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    _run(scenario, dist.get_rank())
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _run(scenario, rank):
    if scenario == "same_bits":
        for dtype in (torch.float32, torch.bfloat16):
            for zero in (dict(stage=1), dict(stage=2), dict(stage=2, reduce_in_backward=True)):
                plain, plain_losses, opt = _train(rank, dtype, False, **zero)
                over, over_losses, _ = _train(rank, dtype, True, **zero)
                assert len(opt.flat_numels()) >= 4, opt.flat_numels()  # several buckets, waited one by one
                assert over_losses == plain_losses, (dtype, zero)
                assert all(torch.equal(a, b) for a, b in zip(over, plain)), (dtype, zero)
                init = Net(dtype).body[0].weight.detach()
                assert not torch.equal(over[0], init), "training did not move the parameters"
                print(f"rank {rank}: {dtype} {zero}: {STEPS} steps, same bits with and without overlap", flush=True)
        print("same_bits ok", flush=True)
    elif scenario == "checkpoint":
        import tempfile

        reference, _, _ = _train(rank, torch.float32, False, stage=2)
        model = Net(torch.float32)
        opt = gpuops.ZeroOptimizer(model.parameters(), lr=2e-2, weight_decay=0.05, bucket_bytes=512, stage=2,
                                   overlap_param_gather=model)
        scaler = gpuops.GradScaler("cpu", init_scale=256.0, growth_interval=5)
        for step in range(STEPS):
            opt.zero_grad()
            for m in range(2):
                x, y = _batch(step, m, rank)
                scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            scaler.set_grad_divisor(opt, 2)
            scaler.clip_grad_norm_(opt, 0.5)
            scaler.step(opt)
            scaler.update()
        # Right after the step, before any forward: state_dict waits (its pre-hook), as TrainingState does.
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        assert all(torch.equal(saved[k], r) for k, r in zip(saved, reference))
        folder = tempfile.gettempdir() + "/gpuops-overlap-ckpt"
        if rank == 0:
            import shutil

            shutil.rmtree(folder, ignore_errors=True)
        torch.distributed.barrier()
        # TrainingState right after another step (nothing waited yet): it waits before it reads the model.
        full_state = _full_state(opt)
        opt.zero_grad()
        x, y = _batch(STEPS, 0, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        twin = Net(torch.float32)
        twin.load_state_dict(saved)
        twin_opt = gpuops.ZeroOptimizer(twin.parameters(), lr=2e-2, weight_decay=0.05, bucket_bytes=512, stage=2)
        twin_opt.load_state_dict(full_state)
        twin_opt.zero_grad()
        torch.nn.functional.mse_loss(twin(x), y).backward()
        twin_opt.step()
        with gpuops.TrainingState(folder, process_group=torch.distributed.group.WORLD) as state:
            state.save(step=STEPS + 1, model=model, optimizer=opt, scaler=scaler)
            fresh = Net(torch.float32)
            fresh_opt = gpuops.ZeroOptimizer(fresh.parameters(), lr=2e-2, weight_decay=0.05, bucket_bytes=512,
                                             stage=2, overlap_param_gather=fresh)
            state.load(model=fresh, optimizer=fresh_opt)
        assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), twin.parameters()))
        print("checkpoint ok", flush=True)
    elif scenario == "deferred":
        import time

        # Reducing in the backward, the step itself communicates only the all-gathers: with rank 1 a second
        # late, rank 0's step returns with its gathers pending, and rank 1's shard of every bucket still holds
        # the values from before the step until something waits (here the model's state_dict pre-hook).
        model = Net(torch.float32)
        opt = gpuops.ZeroOptimizer(model.parameters(), lr=0.1, stage=2, reduce_in_backward=True, bucket_bytes=512,
                                   overlap_param_gather=model)
        before = [p.detach().clone() for p in model.parameters()]
        x, y = _batch(0, 0, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if rank == 1:
            time.sleep(1.0)
        opt.step()
        right_after = [p.detach().clone() for p in model.parameters()]
        after = list(model.state_dict().values())
        unchanged = lambda now: sum(int((a == b).sum()) for a, b in zip(now, before))  # noqa: E731
        total = sum(p.numel() for p in before)
        if rank == 0:
            assert unchanged(right_after) >= total // 3, (unchanged(right_after), total)
        never_called = sum(p.numel() for p in model.unused.parameters())  # no gradient: not stepped (torch's rule)
        assert unchanged(after) == never_called, (unchanged(after), never_called)
        print(f"rank {rank}: right after the step {unchanged(right_after)} of {total} values not yet gathered; "
              f"after the state_dict pre-hook {unchanged(after)}", flush=True)
        print("deferred ok", flush=True)
    elif scenario == "bad_input":
        model = Net(torch.float32)
        with pytest.raises(TypeError, match="overlap_param_gather"):
            gpuops.ZeroOptimizer(model.parameters(), overlap_param_gather="yes")
        opt = gpuops.ZeroOptimizer(model.parameters(), overlap_param_gather=model)
        with pytest.raises(ValueError, match="not one of this optimizer's parameters"):
            opt.wait_for_parameters([torch.zeros(3)])
        opt.wait_for_parameters()  # nothing pending: returns at once
        with pytest.raises(ValueError, match="2 of the 8 parameters are not its parameters"):
            gpuops.ZeroOptimizer(model.parameters(), overlap_param_gather=model.body)
        # Dropped with its gathers pending: the destructor waits, every rank ends with the same parameters.
        x, y = _batch(0, 0, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        del opt
        import gc

        gc.collect()
        assert not any(m._forward_pre_hooks for m in model.modules()), "the hooks outlived their optimizer"
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(WORLD)]
        torch.distributed.all_gather(gathered, flat)
        assert all(torch.equal(g, flat) for g in gathered), "the ranks hold different parameters"
        print("bad_input ok", flush=True)


if __name__ == "__main__":
    _rank_main(sys.argv[1])
