"""ZeRO on CPU processes over Gloo: gpuops.ZeroOptimizer (stages 1, 2 and 3) against torch's
ZeroRedundancyOptimizer (+ DDP), plain DDP + AdamW, and FSDP2 (fully_shard), for 2 and 4 ranks.

    .venv/bin/python bench/zero_comparison.py --world 2 --world 4 [--json out.json]

Per method and world size, rank 0 reports:
- bytes sent per rank per step: ours counted by the communicator's traffic counters (ring algorithm:
  reduce-scatter and all-gather (N-1)/N x the buffer, all-reduce 2(N-1)/N), the scaler-free run has no
  flag/norm all-reduces; DDP's all-reduce bytes counted by a comm hook around its buckets; torch ZeRO's
  broadcasts counted by wrapping torch.distributed.broadcast ((N-1)/N x each broadcast tensor per rank);
  FSDP2 analytic (reduce-scatter + two all-gathers with reshard_after_forward) and labelled so;
- per-rank peak memory: everything allocated from the model's creation through the timed steps, counted by
  gpuops.memory_budget (our counting CPU allocator);
- step time: median of the timed steps, and its ratio to torch's ZeroRedundancyOptimizer in the same run.
The model is an MLP (4 x Linear(1024, 1024)); every method sees the same data; OMP_NUM_THREADS=1 per rank.
gpuops' buckets are 4 MiB (one weight matrix each); "-bwd" reduces them from autograd hooks during backward;
stage 3 makes each Linear a unit, as FSDP2's fully_shard per Linear here ("-nocheck": without the unit-order
check before each gather).
"""

import argparse
import datetime
import json
import os
import statistics
import time

import torch

import rank_processes

METHODS = ["gpuops-zero1", "gpuops-zero2", "gpuops-zero2-bwd", "gpuops-zero3", "gpuops-zero3-nocheck", "torch-zero+ddp",
           "ddp", "fsdp2"]
# overlap_param_gather on and off, timed as whole loops of steps (a barrier per step would wait for the gathers
# the overlap leaves running, outside the timed region): the mean step of TIMED consecutive steps.
LOOP_METHODS = ["gpuops-zero2-bwd-loop", "gpuops-zero2-bwd-overlap-loop"]
WIDTH, LAYERS, BATCH, WARMUP, TIMED = 1024, 4, 32, 3, 10


def _model():
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def _run_method(method, rank, world):
    import torch.distributed as dist

    import gpuops

    sent = {"bytes": 0}
    counted = "counted"
    with gpuops.memory_budget() as budget:
        model = _model()
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if method.startswith("gpuops"):
            comm = gpuops.dist.Communicator(timeout=120)
            # -bwd: reduced from autograd hooks in buckets while backward runs (reduce_in_backward)
            stage = int(method[11])
            if stage == 3:  # a unit per Linear, as fully_shard below; each reduced as its backward ends
                # -nocheck: without the per-gather unit-order check (check_unit_order=False), to price it
                opt = gpuops.ZeroOptimizer(model.parameters(), "adamw", communicator=comm, stage=3, model=model,
                                           units=[m for m in model if isinstance(m, torch.nn.Linear)], lr=1e-3,
                                           check_unit_order="-nocheck" not in method)
            else:
                opt = gpuops.ZeroOptimizer(model.parameters(), "adamw", communicator=comm, stage=stage,
                                           reduce_in_backward="-bwd" in method, bucket_bytes=4 * 2**20, lr=1e-3,
                                           overlap_param_gather=model if "-overlap" in method else False)
            net = model
        elif method == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer)
            fully_shard(model)
            net = model
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            counted = "analytic"
        else:
            from torch.nn.parallel import DistributedDataParallel

            net = DistributedDataParallel(model)

            def counting_hook(state, bucket):
                sent["bytes"] += 2 * bucket.buffer().nbytes * (world - 1) // world
                fut = dist.all_reduce(bucket.buffer().div_(world), async_op=True).get_future()
                return fut.then(lambda f: f.value()[0])

            net.register_comm_hook(None, counting_hook)
            if method == "ddp":
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            else:
                from torch.distributed.optim import ZeroRedundancyOptimizer

                opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
        if method in LOOP_METHODS:
            return _run_loop(method, world, net, opt, comm, rank, param_bytes, budget)
        times = []
        for step in range(WARMUP + TIMED):
            if method.startswith("gpuops"):
                comm.reset_traffic()
            sent["bytes"] = 0
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            x, y = _batch(step, rank)
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        if method.startswith("gpuops"):
            step_bytes = comm.traffic()["ring_sent_bytes"]
        elif method == "fsdp2":
            step_bytes = 3 * param_bytes * (world - 1) // world
        else:
            step_bytes = sent["bytes"]
        peak = budget.peak_bytes
    return {"method": method, "world": world, "ms": 1e3 * statistics.median(times[WARMUP:]),
            "sent_bytes_per_step": step_bytes, "traffic": counted, "param_bytes": param_bytes,
            "one_allreduce_bytes": 2 * param_bytes * (world - 1) // world, "peak_bytes": peak}


def _run_loop(method, world, net, opt, comm, rank, param_bytes, budget):
    import torch.distributed as dist

    def steps(first, count):
        for step in range(first, first + count):
            opt.zero_grad()
            x, y = _batch(step, rank)
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
        opt.wait_for_parameters()  # the last gathers count too

    steps(0, WARMUP)
    dist.barrier()
    comm.reset_traffic()
    t0 = time.perf_counter()
    steps(WARMUP, TIMED)
    ms = 1e3 * (time.perf_counter() - t0) / TIMED
    return {"method": method, "world": world, "ms": ms, "sent_bytes_per_step": comm.traffic()["ring_sent_bytes"] // TIMED,
            "traffic": "counted", "param_bytes": param_bytes, "one_allreduce_bytes": 2 * param_bytes * (world - 1) // world,
            "peak_bytes": budget.peak_bytes}


def _rank_main():
    import gc

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    counter = rank_processes.BroadcastCounter(world)  # torch's ZeRO broadcasts each rank's updated partition

    rows = []
    for method in METHODS + LOOP_METHODS:
        counter.counting, counter.bytes = method == "torch-zero+ddp", 0
        try:
            row = _run_method(method, rank, world)
            if method == "torch-zero+ddp":
                row["sent_bytes_per_step"] += counter.bytes // (WARMUP + TIMED)
        except Exception as e:  # noqa: BLE001 - a method that does not run on CPU is reported, not fatal
            row = {"method": method, "world": world, "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
        gc.collect()
        dist.barrier()
        rows.append(row)
    counter.restore()
    if rank == 0:
        rank_processes.print_rows(rows)
    dist.barrier()
    dist.destroy_process_group()


def _launch(world):
    try:
        return rank_processes.launch(__file__, world, {"GPUOPS_ZERO_BENCH_RANK": "1"}, 1800)
    except RuntimeError as error:
        raise SystemExit(str(error)) from None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, action="append", help="world sizes (default 2 and 4)")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    rows = []
    for world in args.world or [2, 4]:
        rows += _launch(world)
    print("| ranks | method | ms/step | ratio to torch ZeRO | bytes sent/rank/step | / one all-reduce | peak MiB/rank |")
    print("|---|---|---|---|---|---|---|")
    for world in sorted({r["world"] for r in rows}):
        ref = next((r["ms"] for r in rows if r["world"] == world and r["method"] == "torch-zero+ddp" and "ms" in r), None)
        for r in (r for r in rows if r["world"] == world):
            if "error" in r:
                print(f"| {world} | {r['method']} | did not run: {r['error']} | | | | |")
                continue
            ratio = f"{r['ms'] / ref:.2f}" if ref and r["method"] not in LOOP_METHODS else "(loop)"
            print(f"| {world} | {r['method']} | {r['ms']:.1f} | {ratio} | {r['sent_bytes_per_step']:,}"
                  f"{' (analytic)' if r['traffic'] == 'analytic' else ''} | "
                  f"{r['sent_bytes_per_step'] / r['one_allreduce_bytes']:.3f} | {r['peak_bytes'] / 2**20:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    if os.environ.get("GPUOPS_ZERO_BENCH_RANK"):
        _rank_main()
    else:
        main()
