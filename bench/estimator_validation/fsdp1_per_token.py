"""Per-token memory of torch FSDP1 (FullyShardedDataParallel) training at world size 1 and 2, on CPU.

Why: published GPU runs show the peak memory of FSDP1 FULL_SHARD on 2 GPUs growing ~25-35 % more per token
than the same training on 1 GPU (where FSDP1 clamps the strategy to NO_SHARD), and another FSDP1 family
(bf16 autocast, non-reentrant activation checkpointing, decoder layers auto-wrapped) whose GPU-count-
independent part exceeds an exact count of saved activations + fp32-upcast logits. This script measures, with
exact byte counts, what is allocated per token under FSDP1 on the CPU (Gloo), where there is no caching
allocator and there are no CUDA streams: every byte of a difference between world 1 and world 2 comes from
FSDP1's Python code, autograd or the model, not from allocator effects.

What runs: each rank (a local process over Gloo, bench/rank_processes.py) builds a tiny HF LlamaForCausalLM
(h=256, L=4, 4 heads, i=688, V=2000, untied, sdpa attention), wraps it in
    FSDP(model, auto_wrap_policy=transformer_auto_wrap_policy({LlamaDecoderLayer}),
         sharding_strategy=FULL_SHARD, device_id=torch.device("cpu"), use_orig_params=..., mixed_precision=...)
(at world 1 FSDP1 itself switches FULL_SHARD to NO_SHARD: torch/distributed/fsdp/_init_utils.py:429-437), then,
for activation checkpointing, apply_activation_checkpointing(checkpoint_wrapper(NO_REENTRANT)) on the decoder
layers (accelerate's order: FSDP(CheckpointWrapper(LlamaDecoderLayer))), an AdamW optimizer on the parameters
that require grad, and trains two steps (forward with labels -> loss, backward, step, zero_grad(set_to_none=True),
gc.collect()) at batch `--batch` per rank and each sequence length of `--seqs`. The batch carries an all-ones
attention_mask, as a collator's does: without one, transformers 4.57 builds a [b,1,s,s] bool mask from the
position ids (masking_utils.py _preprocess_mask_arguments) and sdpa expands it to float in every layer.

Variants (--variants, default all):
    fp32             fp32 parameters and compute
    fp32-ac          + non-reentrant activation checkpointing on every decoder layer
    bf16mp           MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=bf16)
    bf16mp-ac        + activation checkpointing
    autocast-ac      fp32 parameters, torch.autocast(bf16) around the forward, activation checkpointing
    lora-bf16mp-ac   PEFT LoRA (r=8, all 7 projections) on the frozen base, use_orig_params=True, bf16mp, AC
    lora-autocast-ac PEFT LoRA (all 7 projections), use_orig_params=True, autocast bf16, AC
    lora-qv          PEFT LoRA on q_proj, v_proj only, fp32, use_orig_params=True, no AC
    lora-qv-nofsdp   control: the same LoRA model without FSDP (what autograd saves when frozen weights are
                     plain frozen parameters)
    fp32-noshard     control: NO_SHARD requested explicitly (world 2 then differs from world 1 only by the
                     all-reduce of gradients, not by sharding)

Measured per (world, variant, seq), on every rank (rank 0's row is printed; `peak_ranks` has every rank's peak):
    peak       bytes allocated through torch's CPU allocator above a baseline taken before the model is built
               (gpuops.memory_budget, a counting allocator; measure.py's GpuopsMeter), max over the second
               step's phases: the steady state (parameters, sharded gradients, AdamW state all counted)
    static     bytes live after step 1 (after zero_grad and gc): parameters, optimizer state, kept gradients
    held_fwd   bytes live at the end of step 2's forward minus `static`: what the forward leaves for backward
    act_peak   max(step 2's forward peak, backward peak) minus `static` (the optimizer step left out)
    bwd_extra  step 2's backward peak minus the bytes live at the end of its forward: the backward transient
    saved      unique storages autograd saved in step 2's forward (torch.autograd.graph.saved_tensors_hooks;
               FSDP flat-parameter and parameter storages excluded; inside a non-reentrant checkpoint region the
               checkpoint's own hooks take over, so those tensors are not counted here)
    ckpt_in    unique storages of the tensor arguments of the checkpointed decoder layers (what a non-reentrant
               checkpoint keeps alive until backward instead of the saved activations)
    fsdp_in    unique storages of the tensor arguments FSDP passes to the wrapped modules that are not storages
               of the arguments it received (i.e. copies FSDP made: _cast_forward_inputs, _to_kwargs); 0 means
               FSDP made no per-token copies of inputs
and per (world, variant) the least-squares slope of each quantity in bytes per token (token = one of
batch x seq on a rank), plus world 2's act_peak slope over world 1's ("w/w1").

--device cuda (the GPU run's fsdp1 step, scripts/gpu-run): every rank on the first GPU over Gloo with CUDA
tensors; the peaks are torch.cuda's (max_memory_allocated per phase) and each row adds max_reserved and
reserved_by_stream, the caching allocator's segments per stream at the end of the run: what FSDP1's side streams
hold apart from the default stream's (docs/estimator.md, "The caching allocator, replayed").

--timeline (slower: a TorchDispatchMode records every aten op of step 2's forward+backward) answers whether a
peak-slope difference is a per-token tensor or a move of the peak: with the live bytes after every op at two
seqs (same op sequence), it gives the per-token slope k(t) of the live bytes at every op t, its maximum (the
true per-token high water, independent of where the constant part peaks), where each seq's peak lands and
k there, and lists the live per-token tensors (op, dtype, shape; made in the forward, in a checkpointed
layer's recomputation, or by an autograd node) at the k maximum and at the peak of the largest seq.

Run (2 cores are enough; the default table takes ~4 minutes, a timeline ~10-25 s per variant and world):
    .venv/bin/python bench/estimator_validation/fsdp1_per_token.py
    ... fsdp1_per_token.py --worlds 1 2 --seqs 128 256 512 --batch 2 --variants fp32 fp32-ac --json out.json
    ... fsdp1_per_token.py --timeline --variants bf16mp-ac --seqs 96 320
--json PATH writes {"config", "rows", "slopes"} (with --timeline: {"config", "timeline"}); PATH "-" prints the
JSON instead of the table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # bench/: rank_processes
import rank_processes  # noqa: E402

MODEL = dict(h=256, L=4, a=4, kv=4, i=688, V=2000)
VARIANTS = {
    "fp32":             dict(mp=False, autocast=False, ac=False, lora=False),
    "fp32-ac":          dict(mp=False, autocast=False, ac=True, lora=False),
    "bf16mp":           dict(mp=True, autocast=False, ac=False, lora=False),
    "bf16mp-ac":        dict(mp=True, autocast=False, ac=True, lora=False),
    "autocast-ac":      dict(mp=False, autocast=True, ac=True, lora=False),
    "lora-bf16mp-ac":   dict(mp=True, autocast=False, ac=True, lora=True),
    "lora-autocast-ac": dict(mp=False, autocast=True, ac=True, lora=True),
    "lora-qv":          dict(mp=False, autocast=False, ac=False, lora=True, targets=["q_proj", "v_proj"]),
    "lora-qv-nofsdp":   dict(mp=False, autocast=False, ac=False, lora=True, targets=["q_proj", "v_proj"], fsdp=False),
    "fp32-noshard":     dict(mp=False, autocast=False, ac=False, lora=False, no_shard=True),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ------------------------------------------------------------------------------------------- model
def training_device():
    """Where the ranks train: the CPU, or (--device cuda) the first GPU, shared by every rank of the machine."""
    import torch

    return torch.device("cuda", 0) if os.environ.get("FSDP1_PER_TOKEN_DEVICE") == "cuda" else torch.device("cpu")


def build_model(variant: dict):
    """The HF model (PEFT LoRA on a frozen base for lora variants), FSDP1-wrapped, AC applied; + AdamW."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from measure import model_factory_for

    model = model_factory_for("llama", MODEL, "sdpa", seed=0)()
    if variant["lora"]:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, bias="none",
                                                 target_modules=variant.get("targets", LORA_TARGETS)))
    if variant.get("fsdp") is False:  # control: the same model without FSDP (and without gradient sync)
        model.train()
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    mp = (MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
          if variant["mp"] else None)
    model = FSDP(model,
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                    transformer_layer_cls={LlamaDecoderLayer}),
                 sharding_strategy=ShardingStrategy.NO_SHARD if variant.get("no_shard") else ShardingStrategy.FULL_SHARD,
                 mixed_precision=mp, device_id=training_device(), use_orig_params=variant["lora"],
                 limit_all_gathers=True)
    if variant["ac"]:
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
            check_fn=lambda m: isinstance(m, LlamaDecoderLayer))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return model, opt


# ------------------------------------------------------------------------------------------ probes
class Probes:
    """Counts, during one forward: unique storages autograd saves (minus FSDP parameter storages), the
    tensor inputs of the checkpointed layers, and copies FSDP makes of a wrapped module's inputs."""

    def __init__(self, model):
        import torch
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        self.model = model
        self.active = False
        self.saved, self.saved_dtype, self.ckpt_in, self.fsdp_in = {}, {}, {}, {}
        self._handles = []
        self._fsdp_args = {}
        self.fsdp_units = [m for m in model.modules() if isinstance(m, FSDP)]
        for m in model.modules():
            if isinstance(m, CheckpointWrapper):
                self._handles.append(m.register_forward_pre_hook(self._ckpt_pre, with_kwargs=True))
            if isinstance(m, FSDP):
                # FSDP's own pre-forward runs inside FSDP.forward; what the wrapped module receives is what
                # FSDP passed on: compare with what FSDP.forward was called with
                self._handles.append(m.register_forward_pre_hook(
                    functools.partial(self._fsdp_outer_pre, m), with_kwargs=True, prepend=True))
                self._handles.append(m._fsdp_wrapped_module.register_forward_pre_hook(
                    functools.partial(self._fsdp_inner_pre, m), with_kwargs=True))

    @staticmethod
    def _tensors(args, kwargs):
        import torch
        from torch.utils._pytree import tree_leaves

        return [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]

    def _param_ptrs(self):
        ptrs = set()
        for unit in self.fsdp_units:
            h = unit._handle
            if h is None:
                continue
            fp = h.flat_param
            for t in (fp, getattr(fp, "_local_shard", None), getattr(fp, "_full_param_padded", None),
                      getattr(fp, "_mp_shard", None), getattr(fp, "_full_prec_full_param_padded", None)):
                if t is not None and t.untyped_storage().nbytes() > 0:
                    ptrs.add(t.untyped_storage().data_ptr())
        for t in (*self.model.buffers(), *self.model.parameters()):
            if t.untyped_storage().nbytes() > 0:
                ptrs.add(t.untyped_storage().data_ptr())
        return ptrs

    def _ckpt_pre(self, module, args, kwargs):
        if self.active:
            for t in self._tensors(args, kwargs):
                st = t.untyped_storage()
                self.ckpt_in[st.data_ptr()] = st.nbytes()

    def _fsdp_outer_pre(self, unit, module, args, kwargs):
        if self.active:
            self._fsdp_args[id(unit)] = {t.untyped_storage().data_ptr() for t in self._tensors(args, kwargs)}

    def _fsdp_inner_pre(self, unit, module, args, kwargs):
        if self.active:
            before = self._fsdp_args.pop(id(unit), set())
            for t in self._tensors(args, kwargs):
                st = t.untyped_storage()
                if st.data_ptr() not in before:
                    self.fsdp_in[st.data_ptr()] = st.nbytes()

    def _pack(self, t):
        st = t.untyped_storage()
        key = st.data_ptr()
        if st.nbytes() > 0 and key not in self.saved and key not in self._param_ptrs():
            self.saved[key] = st.nbytes()
            dt = str(t.dtype).replace("torch.", "")
            self.saved_dtype[dt] = self.saved_dtype.get(dt, 0) + st.nbytes()
        return t

    @contextlib.contextmanager
    def forward(self):
        import torch

        self.active = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield
        finally:
            self.active = False

    def result(self):
        return dict(saved=sum(self.saved.values()), saved_by_dtype=self.saved_dtype,
                    ckpt_in=sum(self.ckpt_in.values()), fsdp_in=sum(self.fsdp_in.values()))

    def remove(self):
        for h in self._handles:
            h.remove()


# ------------------------------------------------------------------------------------------ measure
def run_case(variant: dict, batch: int, seq: int, steps: int = 2) -> dict:
    import torch

    from measure import CudaMeter, GpuopsMeter, backward_phase, optimizer_phases

    device = training_device()
    m = CudaMeter() if device.type == "cuda" else GpuopsMeter()
    gc.collect()
    m.start()
    with m.phase("build"):
        model, opt = build_model(variant)
        g = torch.Generator().manual_seed(1 + int(os.environ.get("RANK", "0")))
        input_ids = torch.randint(0, MODEL["V"], (batch, seq), generator=g).to(device)
    probes = Probes(model)
    losses = []
    for step in range(1, steps + 1):
        with m.phase(f"forward/{step}"):
            amp = torch.autocast(device.type, dtype=torch.bfloat16) if variant["autocast"] else contextlib.nullcontext()
            probe = probes.forward() if step == steps else contextlib.nullcontext()
            with amp, probe:
                out = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=input_ids)
            loss = out.loss
            del out
        backward_phase(m, step, loss, losses)
        del loss
        optimizer_phases(m, step, opt, collect=True)
    res = m.finish()
    ph = res["phases"]
    last = [k for k in ph if k.endswith(f"/{steps}")]
    peak_phase = max(last, key=lambda k: ph[k]["peak"])
    static = ph[f"zero_grad/{steps - 1}"]["end"]  # (zero_grad's phase ends after a gc.collect())
    row = dict(peak=ph[peak_phase]["peak"], peak_phase=peak_phase, static=static,
               held_fwd=ph[f"forward/{steps}"]["end"] - static,
               bwd_extra=ph[f"backward/{steps}"]["peak"] - ph[f"forward/{steps}"]["end"],
               fwd_peak=ph[f"forward/{steps}"]["peak"], bwd_peak=ph[f"backward/{steps}"]["peak"],
               act_peak=max(ph[f"forward/{steps}"]["peak"], ph[f"backward/{steps}"]["peak"]) - static,
               losses=losses, **probes.result())
    if device.type == "cuda":  # the caching allocator's segments per stream (FSDP1's side streams keep their own)
        by_stream = {}
        for segment in torch.cuda.memory_snapshot():
            by_stream[str(segment["stream"])] = by_stream.get(str(segment["stream"]), 0) + segment["total_size"]
        row.update(reserved_by_stream=by_stream, max_reserved=max(p["abs_reserved_peak"] for p in ph.values()),
                   max_allocated=max(p["abs_peak"] for p in ph.values()))
    probes.remove()
    del model, opt, probes
    gc.collect()
    return row


# ------------------------------------------------------------------------------------------ timeline
def timeline_case(variant: dict, batch: int, seq: int, snapshots: dict | None = None, steps: int = 2):
    """Step `steps`'s forward+backward as a list of (aten op, bytes live after it, peak bytes during it), both
    above the pre-build baseline; the ops come from a TorchDispatchMode, so FSDP's and autograd's allocations
    (all-gather buffers, casts, pads, gradient copies) are attributed to the op that made them.

    snapshots {name: event index}: at that event, list the storages still alive that some op of this step made
    (StorageWeakRef), each with the op, dtype, shape, and where: "forward:<module>", "recompute:<module>" (a
    checkpointed layer's forward rerun inside backward) or "backward:<autograd node>". Returns (events, snaps)."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from measure import GpuopsMeter

    m = GpuopsMeter()
    gc.collect()
    m.start()
    budget = m._budget
    with m.phase("build"):
        model, opt = build_model(variant)
        g = torch.Generator().manual_seed(1 + int(os.environ.get("RANK", "0")))
        input_ids = torch.randint(0, MODEL["V"], (batch, seq), generator=g)
    events, made, snaps = [], [], {}
    where = {"phase": "forward", "modules": []}
    targets = {i: n for n, i in (snapshots or {}).items()}
    hooks = []
    for name, mod in model.named_modules():
        name = name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")
        hooks.append(mod.register_forward_pre_hook(lambda mod, a, n=name: (where["modules"].append(n), None)[1]))
        # always_call: a non-reentrant checkpoint stops its recomputation early by raising inside the layer
        hooks.append(mod.register_forward_hook(lambda mod, a, o: (where["modules"].pop(), None)[1], always_call=True))

    def context():
        if where["modules"]:
            return ("recompute:" if where["phase"] == "backward" else "forward:") + where["modules"][-1]
        node = torch._C._current_autograd_node()
        return "backward:" + (node.name() if node is not None else "?")

    def snapshot():
        live, seen = [], set()
        for ref, nbytes, info in made:
            if ref.cdata in seen or ref.expired():
                continue
            seen.add(ref.cdata)
            live.append(dict(nbytes=nbytes, **info))
        return live

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            budget.reset_peak()
            out = func(*args, **(kwargs or {}))
            op = str(func.overloadpacket.__name__)
            events.append((op, budget.current_bytes, budget.peak_bytes))
            if snapshots is not None:
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
                        made.append((StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes(),
                                     dict(op=op, where=context(), dtype=str(t.dtype).replace("torch.", ""),
                                          shape=list(t.shape))))
                if len(events) - 1 in targets:
                    snaps[targets[len(events) - 1]] = snapshot()
            return out

    for step in range(1, steps + 1):
        amp = torch.autocast("cpu", dtype=torch.bfloat16) if variant["autocast"] else contextlib.nullcontext()
        rec = Record() if step == steps else contextlib.nullcontext()
        with rec:
            where["phase"] = "forward"
            with amp:
                loss = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=input_ids).loss
            events.append(("<end of forward>", budget.current_bytes, budget.current_bytes))
            where["phase"] = "backward"
            loss.backward()
            events.append(("<end of backward>", budget.current_bytes, budget.current_bytes))
        del loss
        opt.step()
        opt.zero_grad(set_to_none=True)
        gc.collect()
    m.finish()
    for h in hooks:
        h.remove()
    del model, opt, made
    gc.collect()
    return events, snaps


def timeline_report(batch: int, by_seq: dict) -> dict:
    """by_seq: {seq: events} of one world. The per-token slope k(t) of the peak during every op t (the op
    sequences of the smallest and largest seq must match), its maximum, its value at the end of the forward,
    and where each seq's peak lands."""
    seqs = sorted(by_seq)
    s1, s2 = seqs[0], seqs[-1]
    e1, e2 = by_seq[s1], by_seq[s2]
    names = [e[0] for e in e1]
    if names != [e[0] for e in e2]:
        return dict(error=f"op sequences differ ({len(e1)} vs {len(e2)} ops)")
    dT = batch * (s2 - s1)
    k = [(b[2] - a[2]) / dT for a, b in zip(e1, e2)]  # per-token slope of the bytes live during each op
    c = [a[2] - k_ * batch * s1 for a, k_ in zip(e1, k)]  # and the intercept
    end_fwd = names.index("<end of forward>")
    i_k = max(range(len(k)), key=lambda i: k[i])
    peaks = {}
    for s in seqs:
        ev = by_seq[s]
        i = max(range(len(ev)), key=lambda j: ev[j][2])
        peaks[s] = dict(index=i, op=ev[i][0], bytes=ev[i][2], per_token_there=k[i], const_there=c[i],
                        phase="forward" if i <= end_fwd else "backward")
    comm = sorted({n for n in names if any(w in n for w in ("gather", "scatter", "reduce", "broadcast"))})
    return dict(n_ops=len(names), max_per_token=k[i_k], max_per_token_index=i_k, max_per_token_op=names[i_k],
                max_per_token_phase="forward" if i_k <= end_fwd else "backward", const_at_max_per_token=c[i_k],
                per_token_at_end_of_forward=k[end_fwd], peaks=peaks, comm_ops=comm)


def summarize_snapshot(live: list, batch: int, seq: int) -> dict:
    """The live storages whose shape has a seq (or batch*seq) dimension, grouped by (where, op, dtype, shape),
    in bytes per token; plus the total of the others (constant-size: parameters, gradients, optimizer)."""
    groups, per_token, const = {}, 0, 0
    for t in live:
        if seq in t["shape"] or batch * seq in t["shape"]:
            key = (t["where"], t["op"], t["dtype"], tuple(t["shape"]))
            groups[key] = groups.get(key, 0) + t["nbytes"]
            per_token += t["nbytes"]
        else:
            const += t["nbytes"]
    top = sorted(groups.items(), key=lambda kv: -kv[1])
    return dict(per_token_bytes_per_token=per_token / (batch * seq), const_bytes_made_this_step=const,
                tensors=[dict(where=k[0], op=k[1], dtype=k[2], shape=list(k[3]), bytes_per_token=v / (batch * seq))
                         for k, v in top])


def _rank_main():
    import torch
    import torch.distributed as dist

    cfg = json.loads(os.environ["FSDP1_PER_TOKEN_CFG"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    import warnings

    warnings.filterwarnings("ignore")
    rows = []
    if cfg.get("timeline"):
        for name in cfg["variants"]:
            by_seq = {seq: timeline_case(VARIANTS[name], cfg["batch"], seq)[0] for seq in cfg["seqs"]}
            rep = timeline_report(cfg["batch"], by_seq)
            smax = max(cfg["seqs"])
            if "error" not in rep:  # rerun the largest seq, listing the live tensors at two moments
                marks = {"max_per_token": rep["max_per_token_index"], "peak": rep["peaks"][smax]["index"]}
                _, snaps = timeline_case(VARIANTS[name], cfg["batch"], smax, marks)
                rep["live_at"] = {n: summarize_snapshot(v, cfg["batch"], smax) for n, v in snaps.items()}
            rows.append(dict(variant=name, world=world, report=rep,
                             events={s: [list(e) for e in ev] for s, ev in by_seq.items()} if cfg.get("keep_events") else None))
            dist.barrier()
        if rank == 0:
            rank_processes.print_rows(rows)
        dist.barrier()
        dist.destroy_process_group()
        return
    for name in cfg["variants"]:
        for seq in cfg["seqs"]:
            row = run_case(VARIANTS[name], cfg["batch"], seq)
            peaks = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(peaks, torch.tensor([row["peak"]]))
            row.update(world=world, variant=name, seq=seq, batch=cfg["batch"],
                       peak_ranks=[int(p.item()) for p in peaks])
            rows.append(row)
            dist.barrier()
    if rank == 0:
        rank_processes.print_rows(rows)
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ report
def slope(xs, ys):
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else float("nan")


QUANTITIES = ("peak", "act_peak", "held_fwd", "bwd_extra", "saved", "ckpt_in", "fsdp_in")


def slopes(rows):
    out = []
    keys = sorted({(r["variant"], r["world"]) for r in rows}, key=lambda k: (list(VARIANTS).index(k[0]), k[1]))
    for variant, world in keys:
        rs = sorted((r for r in rows if r["variant"] == variant and r["world"] == world), key=lambda r: r["seq"])
        toks = [r["batch"] * r["seq"] for r in rs]
        out.append(dict(variant=variant, world=world,
                        **{f"{q}_per_token": slope(toks, [r[q] for r in rs]) for q in QUANTITIES}))
    for s in out:
        ref = next((t for t in out if t["variant"] == s["variant"] and t["world"] == 1), None)
        s["act_peak_slope_vs_world1"] = (s["act_peak_per_token"] / ref["act_peak_per_token"]) if ref else None
    return out


def print_table(rows, sl):
    print(f"{'world':>5} {'variant':<17} {'seq':>4} {'peak':>10} {'phase':<11} {'static':>9} {'held_fwd':>9} "
          f"{'act_peak':>9} {'bwd_extra':>9} {'saved':>9} {'ckpt_in':>8} {'fsdp_in':>7}")
    for r in sorted(rows, key=lambda r: (list(VARIANTS).index(r["variant"]), r["world"], r["seq"])):
        print(f"{r['world']:>5} {r['variant']:<17} {r['seq']:>4} {r['peak']:>10} {r['peak_phase']:<11} "
              f"{r['static']:>9} {r['held_fwd']:>9} {r['act_peak']:>9} {r['bwd_extra']:>9} {r['saved']:>9} {r['ckpt_in']:>8} "
              f"{r['fsdp_in']:>7}")
    print("\nbytes per token (least squares over seq; token = one of batch x seq on a rank)")
    print(f"{'variant':<17} {'world':>5} " + " ".join(f"{q:>10}" for q in QUANTITIES) + f" {'w/w1':>6}")
    for s in sl:
        ratio = s["act_peak_slope_vs_world1"]
        print(f"{s['variant']:<17} {s['world']:>5} " + " ".join(f"{s[q + '_per_token']:>10.1f}" for q in QUANTITIES)
              + (f" {'-':>6}" if ratio is None else f" {ratio:>6.3f}"))


def print_timeline(rep: dict, top: int) -> None:
    for variant, per_world in rep.items():
        for world, r in sorted(per_world.items()):
            print(f"\n=== {variant}  world {world}")
            if "error" in r:
                print("  ", r["error"])
                continue
            print(f"  ops {r['n_ops']}; collectives {r['comm_ops']}")
            print(f"  max per-token live: {r['max_per_token']:.1f} B/token at op {r['max_per_token_index']} "
                  f"({r['max_per_token_op']}, {r['max_per_token_phase']}), constant there {r['const_at_max_per_token']:.0f} B;"
                  f" at the end of forward {r['per_token_at_end_of_forward']:.1f} B/token")
            for s, p in sorted(r["peaks"].items(), key=lambda kv: int(kv[0])):
                print(f"  seq {s}: peak {p['bytes']} B at op {p['index']} ({p['op']}, {p['phase']}): "
                      f"{p['per_token_there']:.1f} B/token + {p['const_there']:.0f} B")
            for moment, snap in r.get("live_at", {}).items():
                print(f"  live per-token tensors at '{moment}' (largest seq): "
                      f"{snap['per_token_bytes_per_token']:.1f} B/token")
                for t in snap["tensors"][:top]:
                    print(f"     {t['bytes_per_token']:8.1f}  {t['dtype']:<9} {str(t['shape']):<18} {t['op']:<24} {t['where']}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--seqs", type=int, nargs="+",
                   help="default 128 256 512; with --timeline 96 320 (seq and batch*seq must not equal a model "
                        "dimension there, or the per-token tensor listing misattributes)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: every rank on the first GPU over Gloo with CUDA tensors, peaks from torch.cuda's "
                        "statistics and the reserve per stream (the table's exact-byte columns are the CPU's)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--json", metavar="PATH", help="write the rows and slopes as JSON ('-': print it instead)")
    p.add_argument("--top", type=int, default=12, help="--timeline: live per-token tensors listed per moment")
    p.add_argument("--timeline", action="store_true",
                   help="instead of the table: per-op live bytes of step 2's forward+backward (rank 0), the "
                        "per-token slope after every op and where each seq's peak lands")
    a = p.parse_args()
    if a.timeline and a.device == "cuda":
        p.error("--timeline counts the CPU allocator's bytes op by op: it takes --device cpu only")
    a.seqs = a.seqs or ([96, 320] if a.timeline else [128, 256, 512])
    cfg = dict(seqs=a.seqs, batch=a.batch, variants=a.variants, model=MODEL, timeline=a.timeline)
    if a.timeline:
        rep = {}
        for world in a.worlds:
            for r in rank_processes.launch(__file__, world, {"FSDP1_PER_TOKEN_WORKER": "1",
                                                            "FSDP1_PER_TOKEN_CFG": json.dumps(cfg),
                                                            "FSDP1_PER_TOKEN_DEVICE": a.device}, 1800):
                rep.setdefault(r["variant"], {})[world] = r["report"]
        if a.json and a.json != "-":
            with open(a.json, "w") as f:
                json.dump(dict(config=cfg, timeline=rep), f, indent=1)
        print_timeline(rep, a.top)
        return
    rows = []
    for world in a.worlds:
        rows += rank_processes.launch(__file__, world, {"FSDP1_PER_TOKEN_WORKER": "1",
                                                        "FSDP1_PER_TOKEN_CFG": json.dumps(cfg),
                                                        "FSDP1_PER_TOKEN_DEVICE": a.device}, 1800)
    sl = slopes(rows)
    if a.json == "-":
        print(json.dumps(dict(config=cfg, rows=rows, slopes=sl), indent=1))
        return
    print_table(rows, sl)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(config=cfg, rows=rows, slopes=sl), f, indent=1)


if __name__ == "__main__":
    if os.environ.get("FSDP1_PER_TOKEN_WORKER"):
        _rank_main()
    else:
        main()
