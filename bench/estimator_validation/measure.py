"""Measure the peak CPU memory of training steps of small Hugging Face causal LMs.

measure_peak(model_factory, optimizer_factory, batch, seq, precision, checkpointing, steps=2) runs
`steps` training steps (forward with labels=input_ids -> .loss, backward, optimizer.step(),
zero_grad(set_to_none=True)) and returns the peak bytes allocated through torch's CPU allocator
ABOVE a baseline taken before the model is built (so weights, buffers, grads and optimizer state all
count), plus where the peak happened (phase, step).

The meter is replaceable: a meter is any object with
    start()              -- take the baseline (called before the model is built)
    phase(name)          -- a context manager marking a phase ("build", "forward/1", ...)
    finish() -> dict     -- {"phases": {name: {"peak": bytes, "end": bytes}}, "total_allocs": n}
                            peak/end are relative to the baseline.
Two meters are provided:
    ProfilerMeter   -- torch.profiler(profile_memory=True); walks the [memory] events in time order
                       (cumulative sum of signed allocation sizes), phases from record_function ranges.
    GpuopsMeter     -- gpuops.memory_budget: a counting allocator in front of c10's CPU allocator
                       (the bytes requested from it, exactly).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from typing import Callable, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16")


# --------------------------------------------------------------------------------------------- meters
class ProfilerMeter:
    """Peak from torch.profiler memory events (cumulative sum of signed sizes, in time order)."""

    def __init__(self):
        self._prof = None
        self._names = []

    def start(self):
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, acc_events=True)
        self._prof.__enter__()

    @contextlib.contextmanager
    def phase(self, name):
        self._names.append(name)
        with torch.profiler.record_function("PHASE::" + name):
            yield

    def finish(self):
        self._prof.__exit__(None, None, None)
        evs = self._prof.profiler.kineto_results.events()
        mem = []
        ranges = []
        for e in evs:
            n = e.name()
            if n == "[memory]":
                if e.device_type() == torch.autograd.DeviceType.CPU:
                    mem.append((e.start_ns(), e.nbytes()))
            elif n.startswith("PHASE::"):
                ranges.append((e.start_ns(), e.start_ns() + e.duration_ns(), n[7:]))
        mem.sort(key=lambda t: t[0])
        ranges.sort()
        # phases are sequential: an event belongs to the last phase that started at or before it
        starts = [(r[0], r[2]) for r in ranges]
        phases = {}
        cur = 0
        ri = -1
        for t, nb in mem:
            while ri + 1 < len(starts) and starts[ri + 1][0] <= t:
                ri += 1
                # a phase starts at the running value
                phases.setdefault(starts[ri][1], {"peak": cur, "end": cur})
            name = starts[ri][1] if ri >= 0 else "(before)"
            cur += nb
            ph = phases.setdefault(name, {"peak": cur, "end": cur})
            ph["peak"] = max(ph["peak"], cur)
            ph["end"] = cur
        last = 0
        for name in self._names:  # phases without memory events keep the running value
            if name not in phases:
                phases[name] = {"peak": last, "end": last}
            last = phases[name]["end"]
        return {"phases": phases, "total_allocs": sum(1 for _, nb in mem if nb > 0)}


class GpuopsMeter:
    """Peak from gpuops.memory_budget: a counting allocator in front of c10's CPU allocator (exact bytes)."""

    def __init__(self):
        import gpuops

        self._budget = gpuops.memory_budget()
        self._phases = {}

    def start(self):
        gc.collect()
        self._budget.__enter__()

    @contextlib.contextmanager
    def phase(self, name):
        self._budget.reset_peak()
        try:
            yield
        finally:
            self._phases[name] = {"peak": self._budget.peak_bytes, "end": self._budget.current_bytes}

    def finish(self):
        allocations = self._budget.stats().allocations
        self._budget.__exit__(None, None, None)
        return {"phases": self._phases, "total_allocs": allocations}


class CudaMeter:
    """Peaks from torch.cuda's allocator statistics: per phase, max_memory_allocated above the start ("peak",
    "end") and the absolute max_memory_allocated / max_memory_reserved ("abs_peak", "abs_reserved_peak": what a
    user reads, the process's earlier allocations such as cuBLAS workspaces included)."""

    def __init__(self):
        self._phases = {}
        self._base = 0

    def start(self):
        gc.collect()
        torch.cuda.synchronize()
        self._base = torch.cuda.memory_allocated()

    @contextlib.contextmanager
    def phase(self, name):
        torch.cuda.reset_peak_memory_stats()
        try:
            yield
        finally:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            self._phases[name] = {"peak": peak - self._base, "end": torch.cuda.memory_allocated() - self._base,
                                  "abs_peak": peak, "abs_reserved_peak": torch.cuda.max_memory_reserved()}

    def finish(self):
        return {"phases": self._phases, "total_allocs": torch.cuda.memory_stats().get("allocation.all.allocated", 0)}


METERS = {"profiler": ProfilerMeter, "gpuops": GpuopsMeter, "cuda": CudaMeter}


# ------------------------------------------------------------------------------------ model helpers
def make_config(kind: str, cfg: dict, attn: str = "sdpa"):
    """A deterministic HF config from a small dict.

    kind 'gpt2': keys h, L, a, V, n_pos (default seq max 256), dropout (default 0.0), tied (default True)
    kind 'llama': keys h, L, a, kv, i, V, n_pos, tied
    kind 'phi3': the llama keys (Phi-3: fused qkv_proj and gate_up_proj, no dropout)
    """
    from transformers import GPT2Config, LlamaConfig, Phi3Config

    if kind == "gpt2":
        p = cfg.get("dropout", 0.0)
        c = GPT2Config(
            n_embd=cfg["h"], n_layer=cfg["L"], n_head=cfg["a"], vocab_size=cfg["V"],
            n_positions=cfg.get("n_pos", 256), n_inner=cfg.get("i"),
            resid_pdrop=p, embd_pdrop=p, attn_pdrop=p,
            tie_word_embeddings=cfg.get("tied", True), use_cache=False,
        )
    elif kind == "llama":
        c = LlamaConfig(
            hidden_size=cfg["h"], num_hidden_layers=cfg["L"], num_attention_heads=cfg["a"],
            num_key_value_heads=cfg.get("kv", cfg["a"]), intermediate_size=cfg["i"], vocab_size=cfg["V"],
            max_position_embeddings=cfg.get("n_pos", 256), tie_word_embeddings=cfg.get("tied", False),
            use_cache=False, attention_dropout=0.0, rms_norm_eps=1e-6,
        )
    elif kind == "phi3":
        c = Phi3Config(
            hidden_size=cfg["h"], num_hidden_layers=cfg["L"], num_attention_heads=cfg["a"],
            num_key_value_heads=cfg.get("kv", cfg["a"]), intermediate_size=cfg["i"], vocab_size=cfg["V"],
            max_position_embeddings=cfg.get("n_pos", 256), tie_word_embeddings=cfg.get("tied", False),
            use_cache=False, attention_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0, rms_norm_eps=1e-6,
            sliding_window=None, pad_token_id=0,
        )
    else:
        raise ValueError(kind)
    c._attn_implementation = attn
    return c


def model_factory_for(kind: str, cfg: dict, attn: str = "sdpa", seed: int = 0) -> Callable[[], torch.nn.Module]:
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    def factory():
        torch.manual_seed(seed)
        c = make_config(kind, cfg, attn)
        from transformers import Phi3ForCausalLM

        cls = {"gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM, "phi3": Phi3ForCausalLM}[kind]
        return cls(c)

    return factory


# PEFT module names of the estimator's LoRA targets (GPT-2's fused c_attn has no per-q/k/v equivalent).
PEFT_TARGETS = {
    "llama": {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
              "down": "down_proj"},
    "gpt2": {"o": "attn.c_proj", "up": "mlp.c_fc", "down": "mlp.c_proj"},
}


def lora_model_factory_for(kind: str, cfg: dict, attn: str, rank: int, targets, dropout: float = 0.0,
                           base: str = "fp32", checkpointing: bool = False, seed: int = 0) -> Callable:
    """A PEFT LoRA model: the HF model (cast to bf16 first when base == "bf16"; get_peft_model then makes the
    adapters fp32, its autocast_adapter_dtype default), gradient checkpointing with enable_input_require_grads
    (the frozen embedding's output must require grad for reentrant checkpointing), lora_alpha = 2·rank."""
    inner = model_factory_for(kind, cfg, attn, seed)

    def factory():
        from peft import LoraConfig, get_peft_model

        model = inner()
        if base == "bf16":
            model.to(torch.bfloat16)
        if checkpointing:
            model.gradient_checkpointing_enable()
            model.enable_input_require_grads()
        config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=dropout, bias="none",
                            target_modules=[PEFT_TARGETS[kind][t] for t in targets], fan_in_fan_out=kind == "gpt2")
        return get_peft_model(model, config)

    return factory


def optimizer_factory_for(name: str, lr: float = 1e-3) -> Callable:
    def factory(params):
        if name == "adamw":  # foreach is the default on CPU? (torch picks foreach only for CUDA tensors)
            return torch.optim.AdamW(params, lr=lr)
        if name == "adamw-foreach":
            return torch.optim.AdamW(params, lr=lr, foreach=True)
        if name == "adamw-fused":
            return torch.optim.AdamW(params, lr=lr, fused=True)
        if name == "adamw-forloop":
            return torch.optim.AdamW(params, lr=lr, foreach=False)
        if name == "sgd":
            return torch.optim.SGD(params, lr=lr)
        if name == "sgd-momentum":
            return torch.optim.SGD(params, lr=lr, momentum=0.9)
        raise ValueError(name)

    return factory


# ------------------------------------------------------------------------------------------ measure
def backward_phase(meter, step: int, loss, losses: list) -> None:
    """A measured step's backward, a phase of `meter`; the loss value is appended to `losses`. (The caller drops
    its loss before optimizer_phases, as a training loop does.)"""
    with meter.phase(f"backward/{step}"):
        loss.backward()
    losses.append(float(loss.detach()))


def optimizer_phases(meter, step: int, optimizer, collect: bool = False) -> None:
    """A measured step's optimizer step and zero_grad(set_to_none=True), each a phase of `meter`; then
    gc.collect() when `collect`, so that cyclic garbage such as hook closures goes now rather than at a random
    later moment."""
    with meter.phase(f"optimizer/{step}"):
        optimizer.step()
    with meter.phase(f"zero_grad/{step}"):
        optimizer.zero_grad(set_to_none=True)
        if collect:
            gc.collect()


def measure_peak(model_factory, optimizer_factory, batch, seq, precision="fp32", checkpointing=False,
                 steps=2, meter: Optional[str | object] = "gpuops", vocab: Optional[int] = None,
                 seed: int = 0, hold_outputs: bool = False, device: str = "cpu",
                 loss_fn: Optional[Callable] = None) -> dict:
    """Run `steps` training steps; return peak bytes above the pre-build baseline and where it landed.

    Returns {"peak": bytes, "peak_phase": "forward/1"|..., "phases": {...}, "build": bytes,
             "param_bytes": ..., "buffer_bytes": ..., "total_allocs": n}
    hold_outputs=True keeps the whole ModelOutput (logits!) alive as a loop's `out = model(...);
    out.loss.backward(); opt.step()` does: through backward and step, until the next forward's output replaces
    it; the default drops everything but .loss. ``device="cuda"`` builds the model there (meter "cuda").
    ``loss_fn(logits, input_ids)`` computes the loss outside the model (after its autocast region) instead of the
    model's own (labels=input_ids); only the loss is kept.
    """
    assert precision in PRECISIONS, precision
    m = METERS[meter]() if isinstance(meter, str) else meter
    gc.collect()
    torch.manual_seed(seed)
    m.start()
    with m.phase("build"), torch.device(device):
        model = model_factory()
        if precision == "bf16":
            model.to(torch.bfloat16)
        if checkpointing:
            model.gradient_checkpointing_enable()
        model.train()
        # (a factory marked takes_model gets the model: ZeRO stage 3 hooks its units)
        takes_model = getattr(optimizer_factory, "takes_model", False)
        opt = optimizer_factory(model) if takes_model else optimizer_factory(model.parameters())
        V = vocab or model.config.vocab_size
        g = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, V, (batch, seq), generator=g, device="cpu").to(device)
    amp = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(precision)
    device_type = torch.device(device).type
    losses = []
    held = None
    for step in range(1, steps + 1):
        with m.phase(f"forward/{step}"):
            ctx = torch.autocast(device_type, dtype=amp) if amp is not None else contextlib.nullcontext()
            with ctx:
                out = model(input_ids=input_ids, labels=None if loss_fn else input_ids)
            loss = loss_fn(out.logits, input_ids) if loss_fn else out.loss
            held = out if hold_outputs else None  # replaces the previous step's output only now
            del out
        backward_phase(m, step, loss, losses)
        del loss
        optimizer_phases(m, step, opt)
    res = m.finish()
    phases = res["phases"]
    step_phases = [k for k in phases if k not in ("build", "(before)")]
    peak_phase = max(step_phases, key=lambda k: phases[k]["peak"])
    pbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bbytes = sum(b.numel() * b.element_size() for b in model.buffers())
    out = {
        "peak": phases[peak_phase]["peak"],
        "peak_phase": peak_phase,
        "phases": phases,
        "build_peak": phases["build"]["peak"],
        "after_build": phases["build"]["end"],
        "param_bytes": pbytes,
        "buffer_bytes": bbytes,
        "input_bytes": input_ids.numel() * input_ids.element_size(),
        "total_allocs": res["total_allocs"],
        "losses": losses,
    }
    del model, opt
    gc.collect()
    return out


if __name__ == "__main__":
    import json

    r = measure_peak(model_factory_for("llama", dict(h=128, L=2, a=8, kv=2, i=344, V=4000)),
                     optimizer_factory_for("adamw"), 4, 128, "fp32", False,
                     meter=sys.argv[1] if len(sys.argv) > 1 else "gpuops")
    print(json.dumps(r, indent=1))
