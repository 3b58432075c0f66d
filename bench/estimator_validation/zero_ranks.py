"""The estimator's per-rank ZeRO figures (`gpuops estimate --zero 1|2 --gpus N`, and `--sharding gpuops` for
stage 3) against the per-rank peaks of gpuops.ZeroOptimizer, measured on CPU processes over Gloo with gpuops.memory_budget (measure.py's meter).

    .venv/bin/python bench/estimator_validation/zero_ranks.py [--world 2]

Each rank trains validate.py's held-out Hugging Face models for two steps with ZeroOptimizer (AdamW; fp32
parameters, and bf16 ones on fp32 masters, estimated as bf16-mixed master-copy)
and measures its peak above the pre-build baseline; rank 0 prints one JSON row per (model, stage) with the
measured peak of every rank, ZeroOptimizer's own state and gradient bytes, and the estimate for that stage
and world size (optimizer_impl "fused": ours steps in one fused pass; zero_reduce "step": ours keeps the flat
gradient from zero_grad() and reduces it at the step); offloaded rows (offload="cpu", --offload-optimizer) measure
the device side: the host's allocations are outside the budget.
"""

import argparse
import datetime
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # bench/: rank_processes
import rank_processes  # noqa: E402

CASES = [("gpt2-tied", 2, 64), ("llama-gqa-untied", 2, 64), ("gpt2-untied-inner", 4, 128)]


def _rank_main():
    import torch
    import torch.distributed as dist

    import gpuops
    from measure import make_config, measure_peak, model_factory_for
    from validate import MODELS

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for name, batch, seq in CASES:
        kind, cfg = MODELS[name]
        # (parameter dtype, stage, reduce_in_backward, bucket_bytes): the default 25 MiB buckets hold each of
        # these models whole; 256 KiB buckets cut them into several. bf16 parameters step on fp32 masters.
        # offload: ZeroOptimizer(offload="cpu") against --offload-optimizer (its host allocations are outside the
        # budget: the peak is the device side's).
        for dtype, stage, bwd, bucket, offload in (
                ("fp32", 1, False, 0, False), ("fp32", 2, False, 0, False), ("fp32", 2, True, 25 * 2**20, False),
                ("fp32", 2, True, 2**18, False), ("fp32", 1, True, 2**18, False), ("bf16", 1, False, 0, False),
                ("bf16", 2, False, 0, False), ("bf16", 2, True, 25 * 2**20, False), ("bf16", 2, True, 2**18, False),
                ("fp32", 2, False, 0, True), ("bf16", 1, False, 0, True), ("bf16", 2, False, 0, True),
                ("fp32", 2, True, 2**18, True)):
            held = {}

            def factory(params):
                opt = gpuops.ZeroOptimizer(params, "adamw", stage=stage, reduce_in_backward=bwd,
                                           bucket_bytes=bucket or 25 * 2**20, lr=1e-3,
                                           offload="cpu" if offload else None)
                held["opt"] = opt
                return opt

            result = measure_peak(model_factory_for(kind, cfg, "sdpa"), factory, batch, seq, dtype, meter="gpuops")
            peaks = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(peaks, torch.tensor([result["peak"]]))
            layout = dict(precision="fp32") if dtype == "fp32" else dict(precision="bf16-mixed", amp="master-copy")
            est = gpuops.estimate(config=make_config(kind, cfg, "sdpa").to_dict(), **layout, optimizer="adamw",
                                  optimizer_impl="fused", zero_stage=stage, num_gpus=world, micro_batch=batch,
                                  seq_len=seq, device="cpu", zero_reduce="backward" if bwd else "step",
                                  zero_bucket_bytes=bucket, offload_optimizer=offload)
            rows.append({"model": name, "batch": batch, "seq": seq, "dtype": dtype, "stage": stage, "world": world,
                         "reduce_in_backward": bwd, "bucket_bytes": bucket, "offload": offload,
                         "measured": [int(p.item()) for p in peaks], "peak_phase": result["peak_phase"],
                         "state_bytes": held["opt"].state_bytes(), "estimated": est.total_bytes,
                         # ZeroOptimizer.state_bytes() counts its fp32 masters with the moments (offloaded: on the
                         # host, with an fp32 copy of a float32 shard too, as the estimate's host memory)
                         "est_optimizer_states": est.optimizer_states + est.master_weights,
                         "est_host": est.host_memory,
                         "est_gradients": est.gradients})
            del held["opt"]
            dist.barrier()
        rows += _stage3_rows(kind, cfg, name, batch, seq, rank, world)
    if rank == 0:
        rank_processes.print_rows(rows)
    dist.barrier()
    dist.destroy_process_group()


def _stage3_rows(kind, cfg, name, batch, seq, rank, world) -> list:
    """ZeroOptimizer(stage=3), the blocks as units, against `--sharding gpuops` (reshard_after_forward both ways)."""
    import torch
    import torch.distributed as dist

    import gpuops
    from measure import make_config, measure_peak, model_factory_for

    rows = []
    for dtype, reshard, offload in (("fp32", True, False), ("fp32", False, False), ("bf16", True, False),
                                    ("bf16", False, False), ("fp32", True, True), ("bf16", True, True)):
        held = {}

        def factory(model):
            units = "model.layers" if kind == "llama" else "transformer.h"
            held["block_fp32_bytes"] = 4 * sum(p.numel() for p in model.get_submodule(units)[0].parameters())
            held["opt"] = gpuops.ZeroOptimizer(model.named_parameters(), "adamw", stage=3, model=model,
                                               units=units, reshard_after_forward=reshard, lr=1e-3,
                                               offload="cpu" if offload else None)
            return held["opt"]

        factory.takes_model = True
        result = measure_peak(model_factory_for(kind, cfg, "sdpa"), factory, batch, seq, dtype, meter="gpuops")
        peaks = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(peaks, torch.tensor([result["peak"]]))
        layout = dict(precision="fp32") if dtype == "fp32" else dict(precision="bf16-mixed", amp="master-copy")
        est = gpuops.estimate(config=make_config(kind, cfg, "sdpa").to_dict(), **layout, optimizer="adamw",
                              optimizer_impl="fused", sharding="gpuops", reshard_after_forward=reshard,
                              num_gpus=world, micro_batch=batch, seq_len=seq, device="cpu",
                              offload_optimizer=offload)
        rows.append({"model": name, "batch": batch, "seq": seq, "dtype": dtype, "stage": 3, "world": world,
                     "reshard_after_forward": reshard, "reduce_in_backward": True, "bucket_bytes": 0,
                     "offload": offload, "block_fp32_bytes": held["block_fp32_bytes"],
                     "measured": [int(p.item()) for p in peaks], "peak_phase": result["peak_phase"],
                     "state_bytes": held["opt"].state_bytes(), "estimated": est.total_bytes,
                     "est_phase": est.peak_phase,
                     "est_optimizer_states": est.optimizer_states + est.master_weights,
                     "est_host": est.host_memory,
                     "est_gradients": est.gradients})
        del held["opt"]
        dist.barrier()
    return rows


def run(world: int = 2) -> list:
    return rank_processes.launch(__file__, world, {"GPUOPS_ZERO_RANKS_WORKER": "1"}, 900)


if __name__ == "__main__":
    if os.environ.get("GPUOPS_ZERO_RANKS_WORKER"):
        _rank_main()
    else:
        parser = argparse.ArgumentParser(description=__doc__)
        parser.add_argument("--world", type=int, default=2)
        for row in run(parser.parse_args().world):
            worst = max(row["measured"], key=lambda m: abs(row["estimated"] - m))
            row["error"] = (row["estimated"] - worst) / worst
            print(json.dumps(row))
