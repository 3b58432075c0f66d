"""Side by side (issue 34): real decoder models trained with gpuops and with the stacks users run today, in one
run, on the same synthetic token stream and seed.

    .venv/bin/python bench/train_compare.py --out /tmp/compare            # CPU, tiny models, 1 and 2 ranks
    .venv/bin/python bench/train_compare.py --smoke --out /tmp/compare    # seconds: what CI runs
    python3 bench/train_compare.py --device cuda --size 1b --worlds 1 --out results/   # one GPU (gpu-run)

Models (transformers configs, random weights, no network): a Llama decoder, GPT-2 (many small tensors) and a
small Qwen2-MoE (experts that some steps route nothing to, so their parameters get no gradient). Every stack
runs in its own processes (Gloo, one rank per process: world 1 is the single-process form), builds the model
from the same seed inside a gpuops.memory_budget on the CPU (the device's peak on CUDA), and trains
STEPS optimizer steps of ACCUM micro-batches, each rank on its own part of the stream.

Stacks (precision: bf16 autocast over fp32 parameters on the CPU; fp16 autocast with a GradScaler on CUDA):
- one process: ``torch`` (autocast, torch's GradScaler on fp16, fused AdamW, clip_grad_norm_, torch.utils.checkpoint
  per block through Hugging Face's gradient_checkpointing_enable) against ``gpuops`` (our GradScaler on fp16,
  gpuops.optim.AdamW's default path, GradAccumulator with clipping, apply_checkpointing per block), and the
  levers as rows of their own: ``gpuops-8bit`` (state_bits=8) and ``gpuops-offload`` (ZeroOptimizer at world
  1, offload="cpu");
- N ranks: ``ddp+torch-zero`` (DDP and torch's ZeroRedundancyOptimizer) against ``gpuops-zero1`` and
  ``gpuops-zero2`` (ZeroOptimizer's defaults: reduced at the step), and the levers ``gpuops-zero2-8bit`` and
  ``gpuops-zero2-offload``;
  ``fsdp2`` (fully_shard per block and the root, under the same autocast) against ``gpuops-zero3`` (a unit
  per block) and ``gpuops-zero3-offload``. FSDP2 cannot train the MoE model at several ranks (CANNOT: its
  row says why); stage 3 is compared with DDP + torch's ZeRO there.

Per stack: tokens/s (median step after WARMUP), on CUDA the energy per token and the mean power and utilisation
(NVML through gpuops.metrics.Recorder's monitor; two ranks on one GPU share its figures), the peak (CPU: the
memory_budget's, max over ranks; CUDA: allocated and reserved), bytes sent per rank per step (ours from the
communicator's counters, DDP's from a comm hook, torch ZeRO's broadcasts wrapped, FSDP2's analytic:
(2 x ACCUM + 1) x the parameters' bytes x (N-1)/N: two all-gathers per micro-batch, one reduce-scatter per
window), the
largest micro-batch under a fixed budget (gpuops.find_max_batch_size run on each stack, --search-mib), and the
loss curve's largest relative deviation from the stack's reference with the bound it is held to:
- same math as the reference (fp32 AdamW, offload): NOISE_FACTOR x the deviation between two equally valid
  references (the reference and its twin: one process, torch with the window's losses summed and the gradients
  divided by its token count before clipping, as fairseq normalises, which is the rounding path of gpuops'
  GradAccumulator; torch ZeRO against plain DDP AdamW; FSDP2 against DDP), floored at FLOOR; bf16 autocast
  amplifies the rounding differences of the two alike, so their distance is the noise a correct
  implementation shows (tests/python/parity.py's rule);
- 8-bit moments: EIGHT_BIT_BOUND, the seed-to-seed spread of final losses that
  tests/python/test_adam8_convergence.py measured (0.0116 of 1.35): quantisation is not float noise.
Output in --out: rows.json, table.md and compare.svg (loss curves overlaid per model; tokens/s and peak per stack).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import rank_processes  # noqa: E402
import results_json  # noqa: E402

MODELS = ["llama", "gpt2", "qwen2-moe"]
SINGLE = ["torch", "torch-sum", "gpuops", "gpuops-8bit", "gpuops-offload"]
RANKS = ["ddp+torch-zero", "ddp+adamw", "gpuops-zero1", "gpuops-zero2", "gpuops-zero2-8bit", "gpuops-zero2-offload",
         "fsdp2", "gpuops-zero3", "gpuops-zero3-offload"]
# Each stack's reference (the peer it replaces; stage 3's second choice where FSDP2 cannot run) and each
# reference's twin (the second valid reference).
PEER = {"gpuops": ["torch"], "gpuops-8bit": ["torch"], "gpuops-offload": ["torch"],
        "gpuops-zero1": ["ddp+torch-zero"], "gpuops-zero2": ["ddp+torch-zero"], "gpuops-zero2-8bit": ["ddp+torch-zero"],
        "gpuops-zero2-offload": ["ddp+torch-zero"], "gpuops-zero3": ["fsdp2", "ddp+torch-zero"],
        "gpuops-zero3-offload": ["fsdp2", "ddp+torch-zero"]}
# Peers that cannot train a model at several ranks, and why (a row saying so instead of a run that aborts).
CANNOT = {("fsdp2", "qwen2-moe"): "FSDP2 reduce-scatters only the parameters with a gradient on each rank; experts "
                                  "routed on one rank and not the other make the ranks' collectives differ, and Gloo "
                                  "aborts the process (pytorch#158719; NCCL hangs)"}
TWIN = {"torch": "torch-sum", "ddp+torch-zero": "ddp+adamw", "fsdp2": "ddp+adamw"}
NOISE_FACTOR, FLOOR, EIGHT_BIT_BOUND = 10, 1e-5, 0.0116 / 1.35
LR, CLIP = 1e-3, 1.0
SIZES = {  # hidden, layers, heads, kv heads, intermediate, vocab
    "smoke": (64, 2, 4, 2, 128, 256),
    "tiny": (256, 4, 8, 4, 688, 4096),
    "1b": (2048, 16, 32, 8, 8192, 32000),
}


# ---------------------------------------------------------------------------------------------------- models
def make_model(name: str, size: str, device: torch.device) -> torch.nn.Module:
    import transformers

    hidden, layers, heads, kv, inter, vocab = SIZES[size]
    if name == "llama":
        config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                          num_hidden_layers=layers, num_attention_heads=heads,
                                          num_key_value_heads=kv, max_position_embeddings=4096)
        cls = transformers.LlamaForCausalLM
    elif name == "gpt2":
        config = transformers.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads,
                                         n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        cls = transformers.GPT2LMHeadModel
    else:  # experts some steps route nothing to: their parameters get no gradient there
        config = transformers.Qwen2MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                             moe_intermediate_size=max(hidden // 2, 32), num_experts=8,
                                             num_experts_per_tok=2, shared_expert_intermediate_size=hidden,
                                             num_hidden_layers=max(layers // 2, 1), num_attention_heads=heads,
                                             num_key_value_heads=kv, max_position_embeddings=4096,
                                             output_router_logits=False)
        cls = transformers.Qwen2MoeForCausalLM
    config._attn_implementation = "sdpa"
    config.use_cache = False
    torch.manual_seed(1234)
    with device:  # initialised where it trains (a 1B model's initialisation on the CPU takes longer than its run)
        return cls(config)


def blocks_path(model) -> str:
    return "transformer.h" if hasattr(model, "transformer") else "model.layers"


def token_batch(step: int, micro: int, rank: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """The synthetic stream: every stack reads the same tokens for the same (step, micro-batch, rank)."""
    g = torch.Generator().manual_seed(100_000 * step + 100 * micro + rank)
    return torch.randint(0, vocab, (batch, seq), generator=g)


# ---------------------------------------------------------------------------------------------------- stacks
class Stack:
    """One stack's model, optimizer and step; sent_bytes() is the traffic of the last step."""

    def __init__(self, name: str, model_name: str, args, rank: int, world: int):
        import torch.distributed as dist

        import gpuops

        self.name, self.world, self.args, self.device = name, world, args, torch.device(args.device)
        self.fp16 = self.device.type == "cuda"
        self.dtype = torch.float16 if self.fp16 else torch.bfloat16
        self.model = make_model(model_name, args.size, self.device)
        self.vocab = self.model.config.vocab_size
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.layers = self.model.get_submodule(blocks_path(self.model))
        self.comm = None
        self.sent = {"bytes": 0}
        self.scaler = None
        self.net = self.model
        moe = model_name == "qwen2-moe"
        if name.startswith("torch") or name in ("ddp+torch-zero", "ddp+adamw", "fsdp2"):
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            gpuops.apply_checkpointing(self.layers, every=1)
        if name in ("torch", "torch-sum"):
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, fused=True)
            self.scaler = torch.amp.GradScaler("cuda") if self.fp16 else None
        elif name in ("gpuops", "gpuops-8bit"):
            self.opt = gpuops.optim.AdamW(self.model.parameters(), lr=LR, state_bits=8 if "8bit" in name else 32)
            self.scaler = gpuops.GradScaler("cuda") if self.fp16 else None
            self.accumulator = gpuops.GradAccumulator(self.opt, args.accum, self.scaler, max_norm=CLIP)
        elif name.startswith("gpuops"):  # ZeroOptimizer: gpuops-offload is its world-1 form
            self.comm = gpuops.dist.Communicator(timeout=300)
            stage = 3 if "zero3" in name else 2 if "zero2" in name else 1
            options = dict(communicator=self.comm, stage=stage, lr=LR, state_bits=8 if "8bit" in name else 32,
                           offload="cpu" if "offload" in name else None)
            if stage == 3:
                self.opt = gpuops.ZeroOptimizer(self.model.named_parameters(), "adamw", model=self.model,
                                                units=blocks_path(self.model), **options)
            else:
                self.opt = gpuops.ZeroOptimizer(self.model.named_parameters(), "adamw", **options)
            self.scaler = gpuops.GradScaler("cuda") if self.fp16 else None
        elif name == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for block in self.layers:
                fully_shard(block)
            fully_shard(self.model)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
            self.scaler = torch.amp.GradScaler("cuda") if self.fp16 else None
        else:  # DDP: torch's ZeRO, or plain AdamW (the twin reference)
            from torch.nn.parallel import DistributedDataParallel

            self.net = DistributedDataParallel(self.model, find_unused_parameters=moe)

            def counting_hook(state, bucket):
                self.sent["bytes"] += 2 * bucket.buffer().nbytes * (world - 1) // world
                fut = dist.all_reduce(bucket.buffer().div_(world), async_op=True).get_future()
                return fut.then(lambda f: f.value()[0])

            self.net.register_comm_hook(None, counting_hook)
            if name == "ddp+torch-zero":
                from torch.distributed.optim import ZeroRedundancyOptimizer

                self.opt = ZeroRedundancyOptimizer(self.model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
            else:
                self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
            self.scaler = torch.amp.GradScaler("cuda") if self.fp16 else None

    def sent_bytes(self) -> int:
        if self.comm is not None:
            return int(self.comm.traffic()["ring_sent_bytes"])
        if self.name == "fsdp2":  # analytic: per micro-batch two all-gathers (reshard after forward), one
            # reduce-scatter at the window's end (gradient sync off before it)
            return (2 * self.args.accum + 1) * self.param_bytes * (self.world - 1) // self.world
        return self.sent["bytes"]

    def _micro_sync(self, last: bool):
        """DDP and FSDP2 reduce only at the window's last micro-batch, as their users write it."""
        if self.name.startswith("ddp"):
            return nullcontext() if last else self.net.no_sync()
        if self.name == "fsdp2":
            self.model.set_requires_gradient_sync(last)
        return nullcontext()

    def step(self, step: int, rank: int, micro_batch: int) -> torch.Tensor:
        """One optimizer step over the window; returns the window's mean loss on this rank (not synchronised)."""
        args, total = self.args, torch.zeros((), device=self.device)
        count = micro_batch * (args.seq - 1)  # the labels the loss averages over (shifted by one)
        if self.comm is not None:
            self.comm.reset_traffic()
        self.sent["bytes"] = 0
        accumulating = hasattr(self, "accumulator")
        if not accumulating:
            self.opt.zero_grad(set_to_none=True)
        for micro in range(args.accum):
            ids = token_batch(step, micro, rank, micro_batch, args.seq, self.vocab).to(self.device)
            with self._micro_sync(micro == args.accum - 1):
                with torch.autocast(self.device.type, dtype=self.dtype):
                    loss = self.net(input_ids=ids, labels=ids).loss
                total += loss.detach() / args.accum
                if accumulating:
                    self.accumulator.backward(loss * count, count)
                elif self.name == "torch-sum":  # fairseq's way: summed losses, the gradients divided at the end
                    (self.scaler.scale(loss * count) if self.scaler else loss * count).backward()
                else:
                    scaled = loss / args.accum
                    (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        if accumulating:
            return total
        if self.comm is not None:  # ZeroOptimizer clips over every rank's shard
            if self.scaler:
                self.scaler.clip_grad_norm_(self.opt, CLIP)
                self.scaler.step(self.opt)
                self.scaler.update()
            else:
                self.opt.clip_grad_norm_(CLIP)
                self.opt.step()
            return total
        if self.scaler:
            self.scaler.unscale_(self.opt)
        if self.name == "torch-sum":
            torch._foreach_div_([p.grad for p in self.model.parameters() if p.grad is not None],
                                float(count * args.accum))
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        if self.scaler:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        return total


# ---------------------------------------------------------------------------------------------------- ranks
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train(stack_name: str, model_name: str, args, rank: int, world: int, search: bool) -> dict:
    import torch.distributed as dist

    import gpuops

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    records, monitor = [], None  # CUDA: the GPU's figures over the timed steps (NVML: Recorder's monitor)
    tokens = args.accum * args.micro_batch * args.seq
    with gpuops.memory_budget(device=device) as budget:
        stack = Stack(stack_name, model_name, args, rank, world)
        losses, seconds, sent = [], [], []
        for step in range(args.steps):
            dist.barrier()
            _sync(device)
            start = time.perf_counter()
            loss = stack.step(step, rank, args.micro_batch)
            _sync(device)
            seconds.append(time.perf_counter() - start)
            sent.append(stack.sent_bytes())
            losses.append(_mean_over_ranks(loss, world))
            if monitor is not None:
                monitor.step_done(tokens=tokens)
            if device.type == "cuda" and step == args.warmup - 1:  # its figures from here: the timed steps
                monitor = gpuops.metrics.Recorder(log_every=args.steps, callback=records.append,
                                                  device_monitor_s=0.1, rank=0, world_size=1)
        peak = budget.peak_bytes
    row = {"model": model_name, "stack": stack_name, "world": world, "losses": losses,
           "step_s": statistics.median(seconds[args.warmup:]),
           "tokens_per_s": world * args.accum * args.micro_batch * args.seq / statistics.median(seconds[args.warmup:]),
           "sent_bytes_per_step": max(sent[args.warmup:]),
           "traffic": "analytic" if stack_name == "fsdp2" else "counted",
           "param_bytes": stack.param_bytes, "peak_bytes": _max_over_ranks(peak)}
    if monitor is not None:
        monitor.close()
        gpu = records[-1] if records else {}
        row.update({k: gpu.get(k) for k in ("joules_per_token", "gpu_power_w", "gpu_util_pct",
                                            "gpu_memory_used_bytes")})
    if device.type == "cuda":
        row["peak_allocated"] = _max_over_ranks(torch.cuda.max_memory_allocated(device))
        row["peak_reserved"] = _max_over_ranks(torch.cuda.max_memory_reserved(device))
    del stack
    if args.search_mib and search:
        row["largest_micro_batch"] = _largest_micro_batch(stack_name, model_name, args, rank, world)
    return row


def _mean_over_ranks(loss: torch.Tensor, world: int) -> float:
    import torch.distributed as dist

    dist.all_reduce(loss)  # (Gloo has no AVG: a sum, then the division)
    return float(loss) / world


def _max_over_ranks(value: int) -> int:
    import torch.distributed as dist

    t = torch.tensor([int(value)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _largest_micro_batch(stack_name, model_name, args, rank, world):
    """gpuops' batch search on this stack under one fixed budget (the same for every stack): the model and its
    optimizer are built inside it; the ranks agree on every trial."""
    import torch.distributed as dist

    import gpuops

    device = torch.device(args.device)
    with gpuops.memory_budget(args.search_mib << 20, device=device):
        try:
            stack = Stack(stack_name, model_name, args, rank, world)
        except torch.OutOfMemoryError:
            return 0
        result = gpuops.find_max_batch_size(lambda b: stack.step(0, rank, b), high=args.search_high,
                                            seed=None, steps_per_trial=1, process_group=dist.group.WORLD,
                                            device=device, verbose=False)
        return result.max_batch


def _faster(kept, row):
    """The faster of two runs of one stack (the first one's losses and batch search kept; whether the second
    trained to the same losses is recorded: a stack that does not repeat itself is worth knowing of)."""
    if kept is None or "error" in kept or "error" in row:
        return row if kept is None or "error" in row else kept
    best = dict(kept if kept["tokens_per_s"] >= row["tokens_per_s"] else row)
    best["losses"] = kept["losses"]
    best["repeats_agree"] = kept.get("repeats_agree", True) and kept["losses"] == row["losses"]
    best["peak_bytes"] = max(kept["peak_bytes"], row["peak_bytes"])
    if "largest_micro_batch" in kept:
        best["largest_micro_batch"] = kept["largest_micro_batch"]
    return best


def _rank_main():
    import torch.distributed as dist

    args = argparse.Namespace(**json.loads(os.environ["GPUOPS_COMPARE_ARGS"]))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    counted = rank_processes.BroadcastCounter(world)
    warm = Stack(args.stacks[0], args.models[0], args, rank, world)  # first-use costs (kernels, allocator caches)
    for step in range(2):                                            # paid before any stack is timed
        warm.step(step, rank, args.micro_batch)
    del warm
    rows = {}
    # The stacks run one after the other: each model's list is run `repeats` times, in alternating order, and
    # each stack keeps its fastest run (a shared machine's noise and the order's warm-ups fall on every stack
    # alike); the losses are the same in every run (checked), the batch search runs in the first only.
    for repeat in range(args.repeats):
        for model_name in args.models:
            for stack_name in args.stacks if repeat % 2 == 0 else args.stacks[::-1]:
                print(f"rank {rank}: {model_name}, {stack_name}, run {repeat + 1}", flush=True)
                key = (model_name, stack_name)
                if world > 1 and key[::-1] in CANNOT:
                    rows[key] = {"model": model_name, "stack": stack_name, "world": world,
                                 "error": f"not run: {CANNOT[key[::-1]]}"}
                    continue
                counted.counting, counted.bytes = stack_name == "ddp+torch-zero", 0
                try:
                    row = _train(stack_name, model_name, args, rank, world, search=repeat == 0)
                    if stack_name == "ddp+torch-zero":
                        searched = 1 if args.search_mib and repeat == 0 else 0
                        row["sent_bytes_per_step"] += counted.bytes // (args.steps + searched)
                except Exception as e:  # noqa: BLE001 - a stack that does not run here is a row saying so
                    row = {"model": model_name, "stack": stack_name, "world": world,
                           "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
                dist.barrier()
                rows[key] = _faster(rows.get(key), row)
    rows = list(rows.values())
    counted.restore()
    if rank == 0:
        rank_processes.print_rows(rows)
    dist.barrier()
    dist.destroy_process_group()


def _launch(world: int, stacks: list, args) -> list:
    shared = dict(vars(args), stacks=stacks)
    threads = "1" if world > 1 else os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads()))
    try:
        return rank_processes.launch(__file__, world, {"GPUOPS_COMPARE_RANK": "1",
                                                       "GPUOPS_COMPARE_ARGS": json.dumps(shared)},
                                     args.timeout, threads)
    except RuntimeError as error:
        raise SystemExit(str(error)) from None


# ---------------------------------------------------------------------------------------------------- report
def deviation(losses, reference) -> float:
    """The loss curve's largest deviation from the reference's, relative to the reference's loss at that step."""
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


def judge(rows: list) -> None:
    """Adds to every row with a reference: its deviation, the bound it is held to, why, and whether it holds."""
    found = {(r["model"], r["stack"], r["world"]): r for r in rows if "losses" in r}
    for row in rows:
        peer = next((p for p in PEER.get(row["stack"], []) if (row["model"], p, row["world"]) in found), None)
        ref = found.get((row["model"], peer, row["world"]))
        if "losses" not in row or ref is None:
            continue
        row["reference"] = peer
        row["deviation"] = deviation(row["losses"], ref["losses"])
        if "8bit" in row["stack"]:
            row["bound"] = EIGHT_BIT_BOUND
            row["bound_why"] = "8-bit moments: the seed-to-seed spread of final losses (test_adam8_convergence.py)"
        else:
            twin = found.get((row["model"], TWIN[peer], row["world"]))
            noise = deviation(twin["losses"], ref["losses"]) if twin else 0.0
            row["bound"] = NOISE_FACTOR * max(noise, FLOOR)
            row["bound_why"] = (f"same math: {NOISE_FACTOR} x the deviation of {TWIN[peer]} from {peer} "
                                f"({noise:.2e}), floored at {FLOOR:g}")
        row["within_bound"] = row["deviation"] <= row["bound"]
        row["tokens_per_s_ratio"] = row["tokens_per_s"] / ref["tokens_per_s"]
        row["peak_ratio"] = row["peak_bytes"] / ref["peak_bytes"]


def table(rows: list, args) -> str:
    lines = [f"# {datetime.date.today()}, {results_json.where(args.device)['device']}, torch {torch.__version__}; "
             f"size {args.size}, {args.steps} steps of {args.accum} x {args.micro_batch} x {args.seq} tokens per rank",
             "", "| model | ranks | stack | tokens/s | vs peer | peak MiB | vs peer | sent MiB/rank/step | largest "
             "micro-batch | loss deviation (bound) |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            said = r["error"] if r["error"].startswith("not run: ") else f"did not run: {r['error']}"
            lines.append(f"| {r['model']} | {r['world']} | {r['stack']} | {said} | | | | | | |")
            continue
        dev = (f"{r['deviation']:.2e} ({r['bound']:.2e}{'' if r['within_bound'] else ', OUT'})"
               if "deviation" in r else "reference")
        sent = f"{r['sent_bytes_per_step'] / 2**20:.2f}{' (analytic)' if r['traffic'] == 'analytic' else ''}"
        vs = (lambda k: f"{r[k]:.2f}x") if "deviation" in r else (lambda k: "-")  # noqa: E731
        lines.append(f"| {r['model']} | {r['world']} | {r['stack']} | {r['tokens_per_s']:.0f} | "
                     f"{vs('tokens_per_s_ratio')} | {r['peak_bytes'] / 2**20:.1f} | {vs('peak_ratio')} | {sent} | "
                     f"{r.get('largest_micro_batch', '-')} | {dev} |")
    return "\n".join(lines) + "\n"


def picture(rows: list, path: str) -> None:
    """Loss curves overlaid per model (one panel per model and world size); tokens/s and peak per stack."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "losses" in r]
    panels = sorted({(r["model"], r["world"]) for r in ok})
    fig, axes = plt.subplots(2, max(len(panels), 1), figsize=(4.5 * max(len(panels), 1), 7.5), squeeze=False)
    for i, (model, world) in enumerate(panels):
        mine = [r for r in ok if r["model"] == model and r["world"] == world]
        for r in mine:
            axes[0][i].plot(r["losses"], label=r["stack"], linestyle="-" if r["stack"].startswith("gpuops") else "--")
        axes[0][i].set_title(f"{model}, {world} rank{'s' if world > 1 else ''}: loss")
        axes[0][i].set_xlabel("step")
        axes[0][i].legend(fontsize=6)
        names = [r["stack"] for r in mine]
        axes[1][i].barh(names, [r["tokens_per_s"] for r in mine], color="tab:blue")
        twin = axes[1][i].twiny()
        twin.plot([r["peak_bytes"] / 2**20 for r in mine], names, "o", color="tab:red")
        axes[1][i].set_xlabel("tokens/s (bars)")
        twin.set_xlabel("peak MiB (dots)")
        axes[1][i].tick_params(axis="y", labelsize=6)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=MODELS)
    parser.add_argument("--worlds", nargs="+", type=int, default=[1, 2], help="1: the single-process stacks; N > 1: "
                        "the sharded ones at N ranks")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="runs of every stack, the fastest kept")
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--stacks", nargs="+", help="only these stacks (default: every one of the world size)")
    parser.add_argument("--search-mib", type=int, default=0, help="the batch search's budget per rank (0: no search)")
    parser.add_argument("--search-high", type=int, default=64)
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--smoke", action="store_true", help="seconds: smoke sizes, 4 steps, every stack")
    parser.add_argument("--out", required=True, help="folder for rows.json, table.md and compare.svg")
    parser.add_argument("--json", help="also the rows and headline figures here (scripts/gpu-run)")
    args = parser.parse_args()
    if args.smoke:
        args.size, args.steps, args.warmup, args.micro_batch, args.seq, args.repeats = "smoke", 4, 1, 2, 32, 1
        args.search_mib, args.search_high = args.search_mib or 64, 8
    for name, low in (("steps", 1), ("accum", 1), ("micro_batch", 1), ("seq", 2), ("search_mib", 0), ("repeats", 1)):
        if getattr(args, name) < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if args.warmup >= args.steps:
        parser.error(f"--warmup must be below --steps ({args.steps}), got {args.warmup}")
    unknown = sorted(set(args.stacks or []) - set(SINGLE) - set(RANKS))
    if unknown:
        parser.error(f"--stacks {unknown} are not stacks; accepted: {SINGLE + RANKS}")
    if any(w < 1 for w in args.worlds):
        parser.error(f"--worlds must be >= 1, got {args.worlds}")
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for world in args.worlds:
        stacks = SINGLE if world == 1 else RANKS
        rows += _launch(world, [s for s in stacks if not args.stacks or s in args.stacks], args)
    judge(rows)
    text = table(rows, args)
    print(text)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text)
    results_json.write_json_atomically(os.path.join(args.out, "rows.json"),
                                       {"rows": rows, "where": results_json.where(args.device), "args": vars(args)})
    picture(rows, os.path.join(args.out, "compare.svg"))
    figures = {f"{r['model']} x{r['world']} {r['stack']}": f"{r['tokens_per_s_ratio']:.2f}x tokens/s, "
               f"{r['peak_ratio']:.2f}x peak, loss {'within' if r['within_bound'] else 'OUT OF'} bound"
               for r in rows if "deviation" in r}
    figures.update({f"{r['model']} x{r['world']} {r['stack']}": f"did not run: {r['error']}" for r in rows
                    if "error" in r})
    results_json.write(args.json, args.device, figures, rows)


if __name__ == "__main__":
    if os.environ.get("GPUOPS_COMPARE_RANK"):
        _rank_main()
    else:
        main()
