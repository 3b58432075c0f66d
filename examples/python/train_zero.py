"""Data-parallel training with gpuops.ZeroOptimizer (ZeRO stage 1, 2 or 3) and a resumable TrainingState.

    torchrun --nproc_per_node 2 examples/python/train_zero.py --steps 20 --state-dir /tmp/zero-run
    # ... preempted (SIGTERM on any rank: every rank saves the same step and exits 0), then resumed on
    # another number of processes; the optimizer state is resharded on load:
    torchrun --nproc_per_node 1 examples/python/train_zero.py --steps 40 --state-dir /tmp/zero-run

Each rank trains a small regression MLP on its own slice of a fixed synthetic data set (Gloo on CPU; with
GPUs use backend "nccl" and move the model to cuda:LOCAL_RANK). Rank 0 prints "step N loss X" for the
global mean loss. With --stage 3 the parameters are sharded too, each Linear a unit gathered around its forward
and backward.
"""

import argparse
import datetime
import gc
import os
import signal

import torch
import torch.distributed as dist

import gpuops


def batch(step: int, rank: int, world: int, per_rank: int = 16):
    """Slice `rank` of the global batch of `step` (the global batch does not depend on the world size)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(64, 8, generator=g)
    y = torch.tanh(0.5 * x.sum(dim=1, keepdim=True))
    per = 64 // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--signal-self-at", type=int, default=-1, help="rank 1 (or 0) sends itself SIGTERM here")
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    units = dict(model=model, units=[model[0], model[2]]) if args.stage == 3 else {}  # stage 3: a unit per Linear
    opt = gpuops.ZeroOptimizer(model.named_parameters(), gpuops.optim.AdamW, stage=args.stage, lr=3e-2, **units)
    with gpuops.TrainingState(args.state_dir, process_group=dist.group.WORLD) as state:
        loaded = state.load(model=model, optimizer=opt, allow_reshard=True)
        start = loaded["step"] if loaded else 0
        if loaded and rank == 0:
            print(f"resumed from {loaded['path']} at step {start} on {world} rank(s)", flush=True)
        # The training figures, one record per 5 steps: rank 0 writes <state-dir>.metrics.jsonl, with the rates
        # summed over the ranks and the optimizer's collective bytes per step (every rank records every step).
        recorder = gpuops.metrics.Recorder(log_every=5, jsonl=args.state_dir.rstrip("/") + ".metrics.jsonl",
                                           start_step=start, communicator=opt.communicator)
        for step in range(start, args.steps):
            opt.zero_grad()
            x, y = batch(step, rank, world)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            recorder.step_done(loss.detach(), optimizer=opt, samples=x.shape[0])
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            if rank == 0:
                print(f"step {step} loss {mean.item() / world:.6f}", flush=True)
            if step == args.signal_self_at and rank == min(1, world - 1):
                os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would; TrainingState catches it
            stop = state.should_stop()  # agreed by every rank
            if stop or (step + 1) % args.save_every == 0 or step + 1 == args.steps:
                path = state.save(step=step + 1, model=model, optimizer=opt)
                if stop:
                    if rank == 0:
                        print(f"stop requested: saved {path}", flush=True)
                    break
        recorder.close()  # every rank: the last record's figures over all ranks
    del opt, recorder  # it holds the process group: drop it before the group goes
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
