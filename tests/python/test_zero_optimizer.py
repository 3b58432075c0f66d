"""gpuops.ZeroOptimizer over torch.distributed's Gloo group: two real processes (this file run as a script,
one per rank; multiprocess_launch.py). Each rank trains a small MLP for 50 steps on fresh random data of its
own with our GradScaler, clipping and accumulation (by hand, and through GradAccumulator), and compares with
single-process training (our AdamW on the concatenated batch, which it regenerates): within 10 times the
distance between that reference and an equally valid one (each rank's loss through its own matmuls). Two
runs give the same bits; the optimizer state per rank is 1/2 of the unsharded plus padding; bad input raises
naming the argument."""

import sys

import pytest
import torch

import gpuops
from multiprocess_launch import launch, run_gloo_rank
from parity import within_noise

WORLD = 2
DEADLINE_S = 60
STEPS = 50


@pytest.mark.parametrize("stage", [1, 2])
def test_matches_single_process(stage):
    for rank, (code, out) in enumerate(launch(__file__, f"train{stage}", WORLD, DEADLINE_S)):
        assert code == 0, f"rank {rank}:\n{out}"
        assert "train ok" in out, out
        print(out)


def test_with_grad_accumulator():
    for rank, (code, out) in enumerate(launch(__file__, "accumulator", WORLD, DEADLINE_S)):
        assert code == 0, f"rank {rank}:\n{out}"
        assert "accumulator ok" in out, out


def test_bad_input():
    for rank, (code, out) in enumerate(launch(__file__, "bad_input", WORLD, DEADLINE_S)):
        assert code == 0, f"rank {rank}:\n{out}"
        assert "bad_input ok" in out, out


def test_communicator_must_be_ours():
    with pytest.raises(TypeError, match="communicator must be a gpuops.dist.Communicator"):
        gpuops.ZeroOptimizer([torch.zeros(2, requires_grad=True)], communicator="gloo")


# ----------------------------------------------------------------------------------------------------- ranks
def _model():
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.Tanh(), torch.nn.Linear(31, 5))


def _batch(step, micro, rank):
    g = torch.Generator().manual_seed(100000 + 1000 * step + 10 * micro + rank)
    x, y = torch.randn(6, 13, generator=g), torch.randn(6, 5, generator=g)
    if step == 20 and micro == 0 and rank == 1:
        x[0, 0] = float("inf")  # one rank overflows: every rank skips the step
    return x, y


def _mse(model, x, y, chunks=1):
    """The batch's mean squared error; with chunks > 1 the mean of each rank's (each through its own matmuls:
    another equally valid order of the float32 sums)."""
    return sum(torch.nn.functional.mse_loss(model(a), b) for a, b in zip(x.chunk(chunks), y.chunk(chunks))) / chunks


def _train(make_opt, batch_of, accumulation=2, chunks=1):
    model = _model()
    opt = make_opt(model.parameters())
    scaler = gpuops.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    clipped = 0
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(accumulation):
            x, y = batch_of(step, m)
            scaler.scale(_mse(model, x, y, chunks)).backward()
        scaler.set_grad_divisor(opt, accumulation)
        clipped += bool(scaler.clip_grad_norm_(opt, 0.55) > 0.55)  # clips about half the steps
        scaler.step(opt)
        scaler.update()
    assert scaler.skipped_steps == 1 and 0 < clipped < STEPS - 1, (scaler.skipped_steps, clipped)
    return [p.detach().clone() for p in model.parameters()], opt




def _run(scenario, dist):
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = gpuops.dist.Communicator(timeout=30)
    options = dict(lr=3e-2, weight_decay=0.05)
    if scenario.startswith("train"):
        stage = int(scenario[-1])
        zero = lambda params: gpuops.ZeroOptimizer(params, communicator=comm, stage=stage, **options)  # noqa: E731
        a, opt = _train(zero, lambda s, m: _batch(s, m, rank))
        b, _ = _train(zero, lambda s, m: _batch(s, m, rank))
        assert all(torch.equal(x, y) for x, y in zip(a, b)), "two runs differ"

        def concatenated(s, m):
            xs, ys = zip(*[_batch(s, m, r) for r in range(world)])
            return torch.cat(xs), torch.cat(ys)

        ref, ref_opt = _train(lambda params: gpuops.optim.AdamW(params, **options), concatenated)
        other, _ = _train(lambda params: gpuops.optim.AdamW(params, **options), concatenated, chunks=world)
        worst, noise = within_noise(a, ref, other, f"stage {stage}")
        init = [p.detach() for p in _model().parameters()]
        assert max(((r - i).abs().max() / r.abs().max()).item() for r, i in zip(ref, init)) > 0.1
        flat = torch.cat([x.flatten() for x in a])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        assert all(torch.equal(g, flat) for g in gathered), "ranks hold different parameters"
        numel = sum(x.numel() for x in a)
        unsharded = sum(s["exp_avg"].nbytes + s["exp_avg_sq"].nbytes for s in ref_opt.state.values())
        total = sum(opt.flat_numels())
        moments = opt.state_bytes() - 4 * len(a)  # one float32 step counter per parameter
        assert unsharded == 8 * numel and moments * world == 8 * total and 0 <= total - numel < 4 * (world + 4)
        if stage == 2:
            assert opt.gradient_bytes() == 4 * total // world
        print(f"rank {rank}: stage {stage} max_rel_err={worst:.3g} (references {noise:.3g}) state bytes "
              f"{opt.state_bytes()} per rank, "
              f"{unsharded} unsharded moments ({numel} elements, {total} padded)", flush=True)
        print("train ok", flush=True)
    elif scenario == "accumulator":  # GradAccumulator: per-sample loss sums and counts, window 2, clipping

        def train(make_opt, batch_of, per_rank=False):
            model = _model()
            opt = make_opt(model.parameters())
            acc = gpuops.GradAccumulator(opt, 2, gpuops.GradScaler("cpu", init_scale=1024.0, growth_interval=7),
                                         max_norm=0.55)
            for step in range(STEPS):
                for m in range(2):
                    x, y = batch_of(step, m)
                    # per_rank: each rank's samples through their own matmuls (the other valid reference)
                    sizes = [len(uneven(step, m, r)[0]) for r in range(world)] if per_rank else [len(x)]
                    loss = sum(((model(a) - b) ** 2).mean(dim=1).sum() for a, b in zip(x.split(sizes), y.split(sizes)))
                    acc.backward(loss, x.shape[0])
            return [p.detach().clone() for p in model.parameters()]

        def uneven(s, m, r):  # rank 1's second micro-batch is half as large: the ranks' counts differ
            x, y = _batch(s, m, r)
            return (x[:3], y[:3]) if r == 1 and m == 1 else (x, y)

        def concatenated(s, m):
            xs, ys = zip(*[uneven(s, m, r) for r in range(world)])
            return torch.cat(xs), torch.cat(ys)

        # The mean over every rank's samples: the divisor is the mean of the ranks' counts (one all-reduce).
        a = train(lambda params: gpuops.ZeroOptimizer(params, communicator=comm, stage=2, **options),
                  lambda s, m: uneven(s, m, rank))
        ref = train(lambda params: gpuops.optim.AdamW(params, **options), concatenated)
        other = train(lambda params: gpuops.optim.AdamW(params, **options), concatenated, per_rank=True)
        worst, noise = within_noise(a, ref, other, "GradAccumulator")
        print(f"rank {rank}: GradAccumulator, stage 2, counts 12 and 9: max_rel_err={worst:.3g} (references "
              f"{noise:.3g})", flush=True)
        print("accumulator ok", flush=True)
    elif scenario == "bad_input":
        model = _model()
        before = [p.data_ptr() for p in model.parameters()]
        with pytest.raises(ValueError, match="stage must be 1"):
            gpuops.ZeroOptimizer(model.parameters(), communicator=comm, stage=4)
        params = list(model.parameters())
        if rank == 1:
            params[2] = torch.nn.Parameter(torch.zeros(6, 31))
        with pytest.raises(ValueError, match=r"the ranks disagree on parameters \(count, shapes, dtypes\)"):
            gpuops.ZeroOptimizer(params, communicator=comm, stage=1)
        with pytest.raises(ValueError, match="learning rate"):
            gpuops.ZeroOptimizer(model.parameters(), communicator=comm, lr=-1.0)
        assert [p.data_ptr() for p in model.parameters()] == before, "a failed construction changed the model"
        opt = gpuops.ZeroOptimizer(model.parameters(), stage=2)  # the default group
        assert opt.stage == 2 and opt.param_groups[0]["params"][0].numel() * world == sum(opt.flat_numels())
        # A disabled scaler's clip_grad_norm_ gives the global norm too (that of the concatenated batch's gradient).
        x, y = _batch(0, 0, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        norm = gpuops.GradScaler("cpu", enabled=False).clip_grad_norm_(opt, 1e9)
        ref = _model()
        xs, ys = zip(*[_batch(0, 0, r) for r in range(world)])
        torch.nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
        want = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ref.parameters()]))
        assert abs(norm.item() - want.item()) <= 1e-6 * want.item(), (norm.item(), want.item())
        print("bad_input ok", flush=True)


if __name__ == "__main__":
    run_gloo_rank(_run, sys.argv[1])
