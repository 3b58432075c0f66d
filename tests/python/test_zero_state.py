"""gpuops.ZeroOptimizer's other optimizers and its state, over torch.distributed's Gloo group with real
processes (this file run as a script, one per rank; multiprocess_launch.py):
- Adam and SGD (chosen by torch.optim's class or by name) against our single-process twins;
- consolidate_state_dict + state_dict give a full state that torch.optim.AdamW loads and continues from as the
  sharded run does (with a torch LR scheduler on both); load_state_dict of it reshards on every rank;
- gpuops.TrainingState saves one file per rank and resumes at another world size only when allowed."""

import os
import sys

import pytest
import torch

import gpuops
from multiprocess_launch import launch
from parity import within_noise

DEADLINE_S = 90


def _ok(outputs, word):
    for rank, (code, out) in enumerate(outputs):
        assert code == 0, f"rank {rank}:\n{out}"
        assert f"{word} ok" in out, out
    print(outputs[0][1])


def test_adam_and_sgd():
    _ok(launch(__file__, "kinds", 2, DEADLINE_S), "kinds")


def test_consolidated_state_loads_into_torch_adamw():
    _ok(launch(__file__, "consolidate", 2, DEADLINE_S), "consolidate")


def test_training_state_resumes_at_another_world_size(tmp_path):
    env = {"GPUOPS_TEST_DIR": str(tmp_path)}
    _ok(launch(__file__, "save", 2, DEADLINE_S, env), "save")
    _ok(launch(__file__, "resume", 1, DEADLINE_S, env), "resume")


# ----------------------------------------------------------------------------------------------------- ranks
def _model():
    torch.manual_seed(4321)
    return torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.Tanh(), torch.nn.Linear(17, 3))


def _batch(step, rank):
    g = torch.Generator().manual_seed(7000 + 100 * step + rank)
    return torch.randn(5, 9, generator=g), torch.randn(5, 3, generator=g)


def _concatenated(step, world):
    xs, ys = zip(*[_batch(step, r) for r in range(world)])
    return torch.cat(xs), torch.cat(ys)


def _train(model, opt, batches, steps, scheduler=None, chunks=1):
    """`chunks` > 1: the loss is the mean of each rank's (each through its own matmuls), another equally valid
    order of the float32 sums than the concatenated batch's."""
    for step in steps:
        opt.zero_grad()
        x, y = batches(step)
        sum(torch.nn.functional.mse_loss(model(a), b) for a, b in zip(x.chunk(chunks), y.chunk(chunks))).div(
            chunks).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _rank_main(scenario):
    import datetime
    import gc

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    _run(scenario, dist)
    gc.collect()  # our objects hold the group: drop them before it is destroyed (test_zero_optimizer.py says why)
    dist.barrier()
    dist.destroy_process_group()


def _run(scenario, dist):
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = gpuops.dist.Communicator(timeout=30)
    mine = lambda step: _batch(step, rank)  # noqa: E731
    everyone = lambda step: _concatenated(step, world)  # noqa: E731
    if scenario == "kinds":
        for cls, ours, options in ((torch.optim.Adam, gpuops.optim.Adam, dict(lr=2e-2, weight_decay=0.1, amsgrad=True)),
                                   ("sgd", gpuops.optim.SGD, dict(lr=5e-2, momentum=0.9, nesterov=True))):
            a, b, c = _model(), _model(), _model()
            zero = gpuops.ZeroOptimizer(a.parameters(), cls, communicator=comm, stage=2, **options)
            _train(a, zero, mine, range(15))
            _train(b, ours(b.parameters(), **options), everyone, range(15))
            _train(c, ours(c.parameters(), **options), everyone, range(15), chunks=world)
            err, _ = within_noise(_params(a), _params(b), _params(c), zero.kind)
            print(f"rank {rank}: {zero.kind} stage 2 max_rel_err={err:.3g}", flush=True)
        # OneCycleLR cycles lr and momentum through the group: both reach the C++ optimizer at every step.
        a, b, c = _model(), _model(), _model()
        zero = gpuops.ZeroOptimizer(a.parameters(), "sgd", communicator=comm, lr=0.05, momentum=0.9)
        ref = gpuops.optim.SGD(b.parameters(), lr=0.05, momentum=0.9)
        other = gpuops.optim.SGD(c.parameters(), lr=0.05, momentum=0.9)
        _train(a, zero, mine, range(15), torch.optim.lr_scheduler.OneCycleLR(zero, max_lr=0.1, total_steps=15))
        _train(b, ref, everyone, range(15), torch.optim.lr_scheduler.OneCycleLR(ref, max_lr=0.1, total_steps=15))
        _train(c, other, everyone, range(15), torch.optim.lr_scheduler.OneCycleLR(other, max_lr=0.1, total_steps=15),
               chunks=world)
        err, _ = within_noise(_params(a), _params(b), _params(c), "SGD under OneCycleLR")
        assert zero.param_groups[0]["momentum"] == ref.param_groups[0]["momentum"] != 0.9
        assert zero._impl.options["momentum"] != 0.9  # synced to the C++ optimizer at the steps
        print(f"rank {rank}: SGD under OneCycleLR (lr and momentum cycled): max_rel_err={err:.3g}", flush=True)
        # Reduced from autograd hooks during backward (buckets of 256 bytes: three), stage 2, with a
        # scaler and accumulation over 2 micro-batches: no full gradient survives a backward.
        a, b, c = _model(), _model(), _model()
        zero = gpuops.ZeroOptimizer(a.parameters(), "adamw", communicator=comm, stage=2, reduce_in_backward=True,
                                    bucket_bytes=256, lr=2e-2)
        ref, other = gpuops.optim.AdamW(b.parameters(), lr=2e-2), gpuops.optim.AdamW(c.parameters(), lr=2e-2)
        scalers = [gpuops.GradScaler("cpu", init_scale=512.0) for _ in range(3)]
        for step in range(12):
            for opt, net, batches, scaler, chunks in ((zero, a, mine, scalers[0], 1), (ref, b, everyone, scalers[1], 1),
                                                      (other, c, everyone, scalers[2], world)):
                opt.zero_grad()
                for m in range(2):
                    x, y = batches(2 * step + m)
                    loss = sum(torch.nn.functional.mse_loss(net(u), v)
                               for u, v in zip(x.chunk(chunks), y.chunk(chunks)))
                    scaler.scale(loss / chunks / 2).backward()
                    if opt is zero:
                        assert all(p.grad is None for p in a.parameters())
                scaler.step(opt)
                scaler.update()
        assert len(zero.flat_numels()) > 2
        err, _ = within_noise(_params(a), _params(b), _params(c), "reduced in backward")
        print(f"rank {rank}: stage 2 reduced in backward, {len(zero.flat_numels())} buckets, accumulation 2: "
              f"max_rel_err={err:.3g}", flush=True)
        with pytest.raises(TypeError, match="unexpected option 'betas' for SGD"):
            gpuops.ZeroOptimizer(_model().parameters(), "sgd", communicator=comm, lr=0.1, betas=(0.9, 0.99))
        with pytest.raises(TypeError, match="optimizer_class must be AdamW, Adam or SGD"):
            gpuops.ZeroOptimizer(_model().parameters(), torch.optim.RMSprop, communicator=comm)
        print("kinds ok", flush=True)
    elif scenario == "consolidate":
        model = _model()
        zero = gpuops.ZeroOptimizer(model.parameters(), torch.optim.AdamW, communicator=comm, lr=3e-2,
                                    weight_decay=0.05)
        _train(model, zero, mine, range(10))
        with pytest.raises(RuntimeError, match="consolidate_state_dict"):
            zero.state_dict()
        zero.consolidate_state_dict(to=0)
        path = os.environ.get("GPUOPS_COMM_DIR", "/tmp") + f"/consolidated-{os.getppid()}.pt"
        if rank == 0:
            sd = zero.state_dict()
            torch.save(sd, path)
            # torch's AdamW loads it into a copy of the model and continues as the sharded run does.
            ref = _model()
            copy_of_model = {k: v.clone() for k, v in model.state_dict().items()}
            ref.load_state_dict(copy_of_model)
            torch_opt = torch.optim.AdamW(ref.parameters(), lr=3e-2, weight_decay=0.05)
            torch_opt.load_state_dict(sd)
            assert torch_opt.state_dict()["param_groups"][0]["weight_decay"] == 0.05
        dist.barrier()
        # load_state_dict of the full state on every rank: each keeps its shard, the state is the same.
        copy = _model()
        copy.load_state_dict(model.state_dict())
        again = gpuops.ZeroOptimizer(copy.parameters(), "adamw", communicator=comm, lr=1.0)
        again.load_state_dict(torch.load(path, weights_only=True))
        again.consolidate_state_dict(to=0)
        if rank == 0:
            a, b = zero.state_dict(), again.state_dict()
            assert a["state"].keys() == b["state"].keys()
            for i in a["state"]:
                for k in a["state"][i]:
                    assert torch.equal(a["state"][i][k], b["state"][i][k]), (i, k)
            assert b["param_groups"][0]["lr"] == 3e-2
        sched = torch.optim.lr_scheduler.StepLR(zero, step_size=3, gamma=0.5)  # torch's schedulers drive it
        _train(model, zero, mine, range(10, 20), sched)
        if rank == 0:
            torch_sched = torch.optim.lr_scheduler.StepLR(torch_opt, step_size=3, gamma=0.5)
            _train(ref, torch_opt, everyone, range(10, 20), torch_sched)
            # The other valid reference: torch's AdamW again, each rank's loss through its own matmuls.
            other = _model()
            other.load_state_dict(copy_of_model)
            other_opt = torch.optim.AdamW(other.parameters(), lr=3e-2, weight_decay=0.05)
            other_opt.load_state_dict(sd)
            _train(other, other_opt, everyone, range(10, 20), torch.optim.lr_scheduler.StepLR(other_opt, 3, 0.5),
                   chunks=world)
            err, _ = within_noise(_params(model), _params(ref), _params(other),
                                  "torch AdamW from the consolidated state")
            assert zero.param_groups[0]["lr"] == torch_opt.param_groups[0]["lr"] < 3e-2
            print(f"rank 0: torch.optim.AdamW continued from the consolidated state, 10 steps with StepLR: "
                  f"max_rel_err={err:.3g} against the sharded run", flush=True)
        print("consolidate ok", flush=True)
    elif scenario in ("save", "resume"):
        directory = os.environ["GPUOPS_TEST_DIR"]
        model = _model()
        zero = gpuops.ZeroOptimizer(model.named_parameters(), communicator=comm, stage=2, lr=2e-2)
        scaler = gpuops.GradScaler("cpu", init_scale=256.0)
        with gpuops.TrainingState(directory + "/state", process_group=dist.group.WORLD) as state:
            if scenario == "save":
                _train(model, zero, mine, range(6))
                path = state.save(step=6, model=model, optimizer=zero, scaler=scaler)
                assert sorted(os.listdir(path)) == ["checksums.json", "rank-00000.pt", "rank-00001.pt", "state.pt"]
                zero.consolidate_state_dict(0)
                if rank == 0:
                    torch.save(zero.state_dict()["state"], directory + "/state6.pt")
                    torch.save(_params(model), directory + "/params6.pt")
                print("save ok", flush=True)
                return
            before = _params(model)
            # Another model (a layer renamed): refused, naming the parameter; nothing changed.
            other = torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.Tanh(), torch.nn.Linear(17, 3))
            renamed = [("first." + n if n.startswith("0.") else n, p) for n, p in other.named_parameters()]
            with pytest.raises(ValueError, match=r"it has '0.weight' where this optimizer has 'first.0.weight'"):
                state.load(model=model, optimizer=gpuops.ZeroOptimizer(renamed, communicator=comm, stage=2),
                           allow_reshard=True)
            with pytest.raises(ValueError, match="allow_reshard"):
                state.load(model=model, optimizer=zero, scaler=scaler)
            assert all(torch.equal(a, b) for a, b in zip(_params(model), before)), "a refused load changed the model"
            loaded = state.load(model=model, optimizer=zero, scaler=scaler, allow_reshard=True)
            assert loaded["step"] == 6 and scaler.get_scale() == 256.0
            assert all(torch.equal(a, b) for a, b in zip(_params(model), torch.load(directory + "/params6.pt")))
            zero.consolidate_state_dict(0)
            saved = torch.load(directory + "/state6.pt")
            got = zero.state_dict()["state"]
            assert zero.state_dict()["param_groups"][0]["param_names"] == [n for n, _ in model.named_parameters()]
            assert all(torch.equal(got[i][k], saved[i][k]) for i in saved for k in saved[i])
            print("resume ok", flush=True)


if __name__ == "__main__":
    _rank_main(sys.argv[1])
