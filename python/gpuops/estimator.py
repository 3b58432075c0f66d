"""The VRAM estimator: peak memory of a training step, before launching it (the `gpuops estimate` engine)."""

from __future__ import annotations

import inspect
import json
import os
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from . import _C


@dataclass(frozen=True)
class Breakdown:
    """Bytes per category at the peak of one training step on one device, and the moment of that peak
    (``peak_phase``: loss-backward, attention-backward, backward-end or optimizer-step).

    Three figures: ``allocated_peak`` (what ``torch.cuda.max_memory_allocated`` sees), ``reserved_peak`` (the
    caching allocator's segments, ``max_memory_reserved``) and ``total_bytes``, the device memory in use as
    nvidia-smi shows it (reserved + CUDA context + NCCL buffers), with its uncertainty band
    ``total_low``..``total_high``; a GPU fits the job when ``total_high`` fits. ``host_memory`` is host RAM
    the setup needs (offloaded or paged optimizer state), on no device."""

    weights: int
    gradients: int
    master_weights: int
    optimizer_states: int
    activations: int
    logits: int
    temporaries: int
    cuda_context: int
    allocator_slack: int
    peak_phase: str = "optimizer-step"
    workspaces: int = 0
    block_rounding: int = 0
    nccl_buffers: int = 0
    host_memory: int = 0
    band_below: int = 0
    band_above: int = 0
    #: What the estimate leaves out, in words (a module that is not a Hugging Face model or a bare parameter
    #: count: no activations or logits); empty when the architecture is modelled.
    notes: tuple = ()

    _NOT_DEVICE = ("peak_phase", "host_memory", "band_below", "band_above", "notes")
    _NOT_ALLOCATED = ("allocator_slack", "cuda_context", "nccl_buffers")

    def byte_items(self) -> dict:
        """The device categories and their bytes (they sum to ``total_bytes``)."""
        return {k: v for k, v in asdict(self).items() if k not in self._NOT_DEVICE}

    @property
    def allocated_peak(self) -> int:
        return sum(v for k, v in self.byte_items().items() if k not in self._NOT_ALLOCATED)

    @property
    def reserved_peak(self) -> int:
        return self.allocated_peak + self.allocator_slack

    @property
    def total_bytes(self) -> int:
        return sum(self.byte_items().values())

    @property
    def total_low(self) -> int:
        return self.total_bytes - self.band_below

    @property
    def total_high(self) -> int:
        return self.total_bytes + self.band_above

    def as_dict(self) -> dict:
        return {**asdict(self), "allocated_peak": self.allocated_peak, "reserved_peak": self.reserved_peak,
                "total": self.total_bytes, "total_low": self.total_low, "total_high": self.total_high}


def _is_hf_config(value) -> bool:
    """A transformers PretrainedConfig (by its class's lineage: transformers need not be imported here)."""
    names = ("PretrainedConfig", "PreTrainedConfig")  # transformers 4, transformers 5
    return any(c.__name__ in names for c in type(value).__mro__) and hasattr(value, "to_json_string")


def _model_spec(model, config, params) -> _C.ModelSpec:
    if model is not None and not isinstance(model, str):  # a live object: its config, or its size
        if config is not None or params is not None:
            raise ValueError("estimate: give exactly one of model, config or params; got 2")
        if _is_hf_config(model):
            model, config = None, model
        elif isinstance(model, torch.nn.Module):
            own = getattr(model, "config", None)
            if _is_hf_config(own):  # a Hugging Face model: its config.json gives the architecture
                model, config = None, own
            else:  # any other module: its tensors only (estimate() warns that activations are not modelled)
                return _module_spec(model)
        else:
            raise TypeError("model must be a preset name or Hugging Face Hub id (str), a transformers "
                            f"PretrainedConfig or a torch.nn.Module, got {type(model).__name__}")
    given = [x is not None for x in (model, config, params)]
    if sum(given) != 1:
        raise ValueError("estimate: give exactly one of model (a preset name, Hub id, config or module), config (a "
                         f"config.json path or dict) or params (a parameter count); got {sum(given)}")
    if model is not None:
        return _C.model_by_name(model)
    if params is not None:
        return _C.model_from_params(params)
    if _is_hf_config(config):
        config = json.loads(config.to_json_string(use_diff=False))
    if isinstance(config, Mapping):
        try:
            text = json.dumps(dict(config), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise type(e)(f"config: the dict is not a JSON document ({e}); give the fields of a config.json") from None
        except RecursionError:
            raise ValueError("config: the dict is nested too deeply to be a config.json (Python's recursion limit "
                             "was reached); give the fields of a config.json") from None
        return _C.model_from_config_json(text, "config")
    if not isinstance(config, (str, bytes, os.PathLike)):
        raise TypeError(f"config must be a path, a dict or a transformers PretrainedConfig, got {type(config).__name__}")
    return _C.model_from_config_file(os.fsencode(config))  # bytes: any file name reaches open()


def _module_spec(module: "torch.nn.Module") -> _C.ModelSpec:
    """A module with no architecture the estimator reads: its trainable floating-point parameters become a bare
    count (weights, gradients and states at the setup's precision); frozen parameters, buffers and integer
    (quantised) tensors are held as stored, at their own size (meta tensors included; cast the module first for
    a pure 16-bit run)."""
    trainable, fixed, seen = 0, 0, set()
    for tensor in list(module.parameters()) + list(module.buffers()):
        if id(tensor) in seen:  # a tied tensor is counted once
            continue
        seen.add(id(tensor))
        if tensor.requires_grad and tensor.is_floating_point():
            trainable += tensor.numel()
        else:
            fixed += tensor.numel() * tensor.element_size()
    name = type(module).__name__
    if trainable == 0:
        raise ValueError(f"model: the {name} has no trainable floating-point parameters (requires_grad=True) to "
                         "estimate a training step for; accepted: a module with at least one")
    spec = _C.model_from_module(trainable, fixed, name)
    # Every entry point (estimate, fit_table, estimate_svg, advise) comes here: the caller may not know that
    # the answer leaves the activations out.
    warnings.warn(f"gpuops.estimate: {_no_architecture(spec)}", EstimateWarning, stacklevel=_caller_level())
    return spec


def _caller_level() -> int:
    """warnings.warn's stacklevel of the first frame outside this package: the user's call, however many of our
    functions it went through (estimate, fit_table, estimate_svg, plot_estimate, advise)."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = inspect.currentframe().f_back, 1
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == package:
        frame, level = frame.f_back, level + 1
    return level


def _no_architecture(spec: _C.ModelSpec) -> str:
    what = "a bare parameter count" if spec.name[:1].isdigit() else f"the module {spec.name}"
    return (f"activations and logits are not modelled: {what} has no architecture the estimator reads, so micro_batch "
            "and seq_len change nothing and every figure (and a fit) is a lower bound; give a preset, a Hugging Face "
            "model or config, or a config.json (config=) for them")


class EstimateWarning(UserWarning):
    """An estimate that leaves out part of the step (the activations of a module with no architecture)."""


# The command line's names for four of estimate()'s keywords, accepted as they are: gpuops estimate --batch 4
# is estimate(..., batch=4) or estimate(..., micro_batch=4).
_CLI_SPELLINGS = {"batch": "micro_batch", "seq": "seq_len", "gpus": "num_gpus", "zero": "zero_stage"}
_CLI_DEFAULTS = {"micro_batch": 1, "num_gpus": 1, "zero_stage": 0}  # seq_len: _C.default_seq_len(spec)


def estimate(
    model: Union[str, "torch.nn.Module", Any, None] = None,
    *,
    config: Union[str, os.PathLike, Mapping, None] = None,
    params: Union[int, str, None] = None,
    precision: str = "bf16-mixed",
    amp: str = "autocast",
    optimizer: str = "adamw",
    optimizer_impl: str = "default",
    zero_stage: Optional[int] = None,
    num_gpus: Optional[int] = None,
    checkpointing: str = "none",
    attention: str = "sdpa",
    lora_rank: int = 0,
    lora_targets: Sequence[str] = ("q", "v"),
    base_dtype: str = "bf16",
    micro_batch: Optional[int] = None,
    seq_len: Optional[int] = None,
    grad_accum: int = 1,
    zero_grad: str = "none",
    zero_reduce: str = "backward",
    zero_bucket_bytes: int = 0,
    sharding: str = "flat",
    reshard_after_forward: bool = True,
    zero_prefetch: int = 1,
    ds_reduce_bucket: Union[int, str] = 500_000_000,
    reduce_dtype: str = "grad",
    offload_optimizer: bool = False,
    fsdp_orig_params: bool = False,
    quantize_lm_head: bool = False,
    bnb_version: str = "0.45.0",
    loss: str = "standard",
    lora_dropout: float = 0.0,
    compile: bool = False,
    held_logits: str = "none",
    model_code: str = "hf",
    device: str = "cuda",
    gpu: Optional[str] = None,
    cuda: int = 13,
    module_loading: str = "lazy",
    allocator: str = "default",
    context_bytes: Optional[int] = None,
    device_profile: Union[str, os.PathLike, None] = None,
    batch: Optional[int] = None,
    seq: Optional[int] = None,
    gpus: Optional[int] = None,
    zero: Optional[int] = None,
) -> Breakdown:
    """Peak memory of one training step, per GPU (``device="cuda"``) or on the CPU (``device="cpu"``): the
    engine and the defaults of ``gpuops estimate``, so the same model and options give the same bytes.

    The architecture (one of): ``model``, a preset name (``gpuops.presets()``), a Hugging Face Hub id whose
    config.json is in the local Hub cache (``"meta-llama/Llama-3.2-1B"``; nothing is downloaded), a
    ``transformers`` ``PretrainedConfig``, or a live ``torch.nn.Module`` (a Hugging Face model by its
    ``config``; any other module by its parameter and buffer count, meta tensors included, as a bare count);
    ``config``, a ``config.json`` path or dict (gpt2, bert or any decoder-only model, MoE included; an unknown
    ``model_type`` is read Llama-style and the assumptions are listed in
    ``gpuops._C.model_from_config_json(...).assumptions``) or a ``PretrainedConfig``; ``params``, a bare
    parameter count (``7_000_000_000`` or ``"7B"``).

    The options are those of ``gpuops estimate``, with the same defaults (``seq_len`` 2048, or a learned
    position table's length if shorter; micro-batch 1; one GPU; no ZeRO; ``None`` for any of these four
    takes its default). Four have longer names here, and
    the command line's are accepted too: ``micro_batch`` (``batch``, ``--batch``), ``seq_len`` (``seq``),
    ``num_gpus`` (``gpus``), ``zero_stage`` (``zero``); the others map ``--lora-rank`` to ``lora_rank``. A
    value of the wrong type raises ``TypeError`` and a bad value ``ValueError``, each naming the argument
    (integers must be ints: ``micro_batch=2.5`` or ``"2"`` is a TypeError; a setup whose
    bytes would pass 2**63 is a ValueError naming the size that is too large). ``lora_targets`` is a sequence
    of names or one comma list (``"q,v"``). ``amp`` says where mixed
    precision keeps its weights: ``"autocast"`` (torch.autocast: fp32 weights) or ``"master-copy"`` (16-bit
    weights and an fp32 master copy); ``optimizer_impl`` is ``"default"`` (torch's for the device),
    ``"for-loop"``, ``"foreach"`` or ``"fused"``.

    Optimizers, offload and sharding (docs/estimator.md): ``optimizer`` also takes ``"adafactor"``
    (transformers' Adafactor defaults: factored fp32 second moment), ``"paged-adamw-8bit"`` and
    ``"paged-adamw-32bit"`` (bitsandbytes; states of tensors of >= 100,000 values in host memory), and
    ``"gpuops-adamw-8bit"`` (gpuops.optim.AdamW(state_bits=8): 8-bit moments per 256 values for tensors of
    >= 4096 values).
    ``offload_optimizer=True`` is ZeRO-Offload (states, fp32 master and the step on the host).
    ``fsdp_orig_params=True`` (with ``sharding="fsdp1"``) is FSDP1's ``use_orig_params=True``: with LoRA a block's
    frozen weights are views of a flat parameter that requires grad, so they save their inputs and get gradients
    (sharded, kept from the backward to the next forward) as trainable weights do.
    ``sharding="fsdp1"`` is torch's ``FullyShardedDataParallel`` with ``FULL_SHARD`` (the flat partitions, no
    DeepSpeed bucket, the root unit gathered from its forward to the end of the backward; ``zero_stage`` 0 means 3).
    ``sharding="fsdp2"`` is torch's ``fully_shard`` (per-tensor dim-0 shards; ``zero_stage`` 0 means 3) with
    ``reshard_after_forward`` as given to the blocks and ``reduce_dtype`` its MixedPrecisionPolicy's (``"grad"``:
    the gradients' dtype, ``"fp32"``: float32 reduce-scatters, as torchtitan). ``sharding="gpuops"`` is
    ``gpuops.ZeroOptimizer(stage=3)`` (one flat buffer per block, the rest of the model one more unit, fp32
    gradient shards; ``zero_stage`` 0 means 3) with ``reshard_after_forward`` and ``zero_prefetch`` (its
    ``prefetch``: units gathered ahead). ``ds_reduce_bucket`` is DeepSpeed ZeRO-3's ``reduce_bucket_size`` (zero 3,
    sharding flat): the elements of the gradient bucket it makes at setup (DeepSpeed's default 5e8, which
    accelerate's configs keep; ``"auto"``: Hugging Face's ``hidden_size**2``; 0: ``contiguous_gradients`` off).
    ``base_dtype`` also takes ``"nf4-nodq"`` (NF4 without double quantisation) and ``"fp32"`` (an fp32 base, e.g.
    LoRA at ``precision="fp32"``);
    ``quantize_lm_head=True`` stores an untied LM head like an int8/nf4 base; ``bnb_version`` is the
    bitsandbytes release of an int8/nf4 base (``"0.42.0"``: before 0.43.2 the 4-bit matmul keeps its input for
    the backward, before 0.45.0 the int8 matmul also keeps an int8 copy; later releases behave as 0.45.0); and
    ``lora_targets`` also takes ``"lm_head"`` and ``"embed"``. The bools must be bools (``TypeError``).

    Checkpointing policies, chunked loss, LoRA dropout, torch.compile (docs/estimator.md):
    ``checkpointing="selective"`` is op-level selective checkpointing of every block (non-reentrant
    ``torch.utils.checkpoint`` with torchtitan's "op" policy: every other ``aten.mm`` output and, on CUDA, the
    SDPA outputs are kept). ``loss`` is ``"standard"`` (Hugging Face's cross-entropy on logits upcast to
    fp32), ``"no-upcast"`` (``cross_entropy`` on the 16-bit logits, outside autocast: lightning-thunder's
    benchmark), ``"chunked:C"`` (torchtune's ``CEWithChunkedOutputLoss``, ``C`` token chunks, each upcast; LitGPT's
    ``chunked_cross_entropy`` under Fabric, which hands it fp32 logits), ``"chunked-no-upcast:C"`` (the same on
    16-bit logits) or ``"fused-linear-ce"`` (Liger's fused
    linear cross-entropy); docs/estimator.md lists which frameworks upcast. ``lora_dropout`` is PEFT's ``lora_dropout``, a
    float ``0 <= p < 1`` (LoRA only). ``compile=True`` models ``torch.compile`` of the model (inductor's saved
    tensors; not with ``attention="eager"``). ``held_logits`` is what the training loop keeps of the model's
    output through the backward: ``"none"`` (only the loss, as the Hugging Face Trainer), ``"model"`` (the
    logits in the LM head's dtype: ``out = model(**batch); out.loss.backward()``) or ``"fp32"`` (torchtune
    before 0.3, which upcasts the logits in the model and keeps them). ``model_code`` is the model's
    implementation: ``"hf"`` (the transformers class) or ``"litgpt"`` (LitGPT's ``GPT``, one fused q|k|v linear
    on every architecture: with RoPE its output stays alive through the v attention saves).

    ``zero_grad`` says what ``optimizer.zero_grad()`` leaves between steps: ``"none"`` (``set_to_none=True``,
    torch >= 2.0's default: the forward runs without gradients) or ``"zeros"`` (torch < 2.0's default: they
    stay allocated through the next step).

    ``zero_reduce`` (ZeRO stages 1-2): ``"backward"`` (gradients reduced in buckets while backward runs, as
    DeepSpeed and Megatron do: stage 2 holds 1/N of them) or ``"step"`` (gpuops.ZeroOptimizer: the full flat
    gradient is kept from ``zero_grad()`` and reduce-scattered at the step; stage 2 adds its fp32 shard).
    ``zero_bucket_bytes`` (with ``"backward"``): ``0`` models DeepSpeed and Megatron (their bucket buffers not
    counted); ``B > 0`` models ``gpuops.ZeroOptimizer(reduce_in_backward=True, bucket_bytes=B)``: its fp32
    gradient shard and up to three buckets in flight at the end of the backward.

    The CUDA software (``device="cuda"``): ``gpu`` a catalog GPU whose profile to use (its compute capability:
    context and workspaces; ``None``: an H100), ``cuda`` the CUDA major version of the torch build (11-13),
    ``module_loading`` ``"lazy"`` (torch's default) or ``"eager"``, ``allocator`` ``"default"`` or
    ``"expandable"`` (``expandable_segments:True``), ``context_bytes`` a measured CUDA context (nvidia-smi minus
    ``max_memory_reserved``) instead of the table's, ``device_profile`` a ``device-profile.json`` measured on a GPU
    by ``bench/estimator_validation/calibrate_device.py`` (its context and workspaces replace the table's for
    GPUs of its compute capability; ``context_bytes`` wins over it).
    """
    keywords = {k: v for k, v in locals().items() if k != "model"}
    spec, device, setup = _estimate_inputs("estimate", model, keywords, keep_gpu=True)
    # Types and ranges are checked in C++ (gpuops._C), each error naming its argument.
    items, phase, off_device = _C.estimate_memory(spec, device, **setup)
    return Breakdown(**dict(items), peak_phase=phase, **off_device, notes=_notes_of(spec))


def _notes_of(spec: _C.ModelSpec) -> tuple:
    return (_no_architecture(spec),) if spec.family == "params-only" else ()


def _path_or_none(name: str, path) -> Optional[bytes]:
    """A path as bytes (any file name reaches open()), or None."""
    if path is None:
        return None
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"{name} must be a path or None, got {type(path).__name__}")
    return os.fsencode(path)


def presets() -> list:
    """Names of the built-in architectures."""
    return _C.preset_names()


def gpu_catalog() -> list:
    """The GPU models the estimator knows, as ``gpuops gpus --json`` lists them: memory, compute capability and
    tensor-core precisions, bandwidth, 16-bit tensor rate and a typical spot price."""
    code, out, err = _C.run_cli(["gpus", "--json"])
    if code != 0:  # the catalog is built in; a failure here is a bug, not bad input
        raise RuntimeError(err.decode(errors="replace").strip())
    return json.loads(out)["gpus"]


# --- Pictures and advice (docs/estimator.md, "Pictures and advice"): the C++ engine of `gpuops estimate
# --plot` and `--advise` through gpuops._C, so Python draws the same SVG and gives the same advice.


def _estimate_inputs(caller: str, model, keywords: dict, keep_gpu: bool = False):
    """The model spec, the device and the setup keywords of an estimate() call with ``keywords``: estimate()'s
    own keywords and defaults, so these functions take exactly what estimate() takes; the command line's
    spellings (batch, seq, gpus, zero) become estimate()'s names, and the defaults are the command line's."""
    params = inspect.signature(estimate).parameters
    defaults = {n: p.default for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    for name in keywords:
        if name not in defaults:
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")
    merged = {**defaults, **keywords}
    for cli_name, name in _CLI_SPELLINGS.items():
        value = merged.pop(cli_name)
        if value is not None and merged[name] is not None:
            raise TypeError(f"{caller}(): {name} and {cli_name} (its command-line spelling) are the same setting; "
                            "give one")
        if value is not None:
            merged[name] = value
    spec = _model_spec(model, merged.pop("config"), merged.pop("params"))
    for name, value in _CLI_DEFAULTS.items():
        merged[name] = value if merged[name] is None else merged[name]
    if merged["seq_len"] is None:
        merged["seq_len"] = _C.default_seq_len(spec)
    device = merged.pop("device")
    if not keep_gpu:
        merged.pop("gpu")  # the callers take gpu themselves
    merged["device_profile"] = _path_or_none("device_profile", merged["device_profile"])
    return spec, device, merged


def fit_table(model=None, *, recommend: bool = False, **keywords) -> list:
    """The GPU table of ``gpuops estimate``: for every catalog GPU (``recommend=True``: only those that fit,
    cheapest first), estimated on its own CUDA profile, a :class:`GpuFit` with whether the setup fits (the top of
    the uncertainty band), the bytes used, the headroom, the largest micro-batch that fits (None for a bare
    parameter count) and the price. Takes the arguments of :func:`estimate`; ``gpu`` keeps that GPU's row only,
    as ``--gpu`` does."""
    if not isinstance(recommend, bool):
        raise TypeError(f"recommend must be a bool (True or False), got {type(recommend).__name__}")
    spec, _device, setup = _estimate_inputs("fit_table", model, keywords, keep_gpu=True)
    only = setup.pop("gpu")
    rows = [GpuFit(**row) for row in json.loads(_C.fit_table_json(spec, recommend, **setup))]
    if only is not None:
        name = _C.find_gpu_name(only)  # a catalog name, ValueError listing them otherwise
        rows = [r for r in rows if r.name == name]
    return rows


@dataclass(frozen=True)
class GpuFit:
    """One row of :func:`fit_table` (the ``gpus`` entries of ``gpuops estimate --json``)."""

    name: str
    memory_bytes: int
    fits: bool                 #: the top of the uncertainty band fits, at the requested micro-batch
    precision_supported: bool  #: False for bf16 on a GPU without it
    total_bytes: int
    total_high_bytes: int
    headroom_bytes: int        #: memory minus total_high_bytes
    max_micro_batch: Optional[int]  #: the largest that fits (0: not even 1); None without an architecture
    spot_price_usd_per_hour: float


def estimate_svg(model: Optional[str] = None, *, gpu: Optional[str] = None, **keywords) -> str:
    """The SVG picture of ``gpuops estimate --plot``, as text: a stacked bar per moment of the step (by
    category, the peak outlined and labelled with its largest term, a GiB axis and a legend, and a line at
    ``gpu``'s memory when given) and the largest micro-batch per catalog GPU (0 where micro-batch 1 does not
    fit). Takes the arguments of :func:`estimate` (``model``, ``config``, ``params``, the setup keywords and
    ``device``); with ``gpu`` (a catalog name) and ``device="cuda"`` the bars use that GPU's CUDA profile."""
    spec, device, setup = _estimate_inputs("estimate_svg", model, keywords)
    return _C.estimate_svg(spec, device, gpu, **setup)


def plot_estimate(path: Union[str, bytes, os.PathLike], model: Optional[str] = None, *, gpu: Optional[str] = None,
                  **keywords) -> str:
    """Writes :func:`estimate_svg`'s picture to ``path`` (through a temporary file in the same folder,
    renamed over it) and returns the path. ``OSError`` when it cannot be written (a missing folder, a
    directory, no permission); ``path`` must be a str, bytes or os.PathLike (``TypeError``)."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"path must be a str, bytes or os.PathLike, got {type(path).__name__}")
    svg = estimate_svg(model, gpu=gpu, **keywords)
    _C.write_file_atomically(os.fsencode(path), svg)
    return os.fsdecode(path)


@dataclass(frozen=True)
class Advice:
    """One change of the setup and its estimate on the GPU (see :func:`advise`)."""

    description: str      #: the change in words
    options: str          #: the same as ``gpuops estimate`` options
    changes: int          #: 1, or 2 or 3 for a combination of changes
    keeps_numerics: bool  #: cost != "numerics"
    cost: str             #: besides memory: "none", "recompute", "slower", "communication" or "numerics"
    saved_bytes: int      #: the setup as given minus this one (total_bytes)
    fits: bool            #: on the GPU, by the catalog's criterion (the top of the uncertainty band)
    total_bytes: int      #: device memory used (Breakdown.total_bytes on the GPU's CUDA profile)
    total_high_bytes: int  #: the top of its uncertainty band (what must fit)
    headroom_bytes: int   #: the GPU's memory minus total_high_bytes
    breakdown: Breakdown
    setup: dict           #: estimate()'s keywords for the changed setup: ``estimate(model, **a.setup)``


class AdviceList(list):
    """The advice, fitting changes first, with the setup as given: ``gpu``, ``memory_bytes``, ``total_bytes``,
    ``total_high_bytes``, ``fits`` and ``headroom_bytes`` (from the top of the band)."""

    gpu: str
    memory_bytes: int
    total_bytes: int
    total_high_bytes: int
    fits: bool
    headroom_bytes: int


def advise(gpu: str, model: Optional[str] = None, **keywords) -> AdviceList:
    """What to change to fit on the catalog GPU ``gpu`` (``gpuops estimate --advise GPU``): every lever the
    estimator models (the fused optimizer, flash attention, a chunked or fused linear cross-entropy, logits not
    held, gradients set to None, ZeRO reduction in the backward, torch.compile, activation checkpointing, a
    smaller micro-batch with more accumulation, optimizer offload, a higher ZeRO stage, the 8-bit, paged or
    Adafactor optimizer, an fp32 master copy, LoRA without dropout, LoRA or QLoRA rank 16 on q,k,v,o), one at a
    time, in pairs when no single change fits and in triples when no pair fits, each estimated on the GPU's CUDA
    profile. Ranked: those that fit first, by ``cost`` (``"none"`` < ``"recompute"`` < ``"slower"`` <
    ``"communication"`` < ``"numerics"``), single changes before combinations, then the most memory saved
    (``saved_bytes``); then those that do not fit, the smallest shortfall first.
    Takes the arguments of :func:`estimate` (``device`` must be ``"cuda"``). The list's attributes describe
    the setup as given (``.fits``, ``.headroom_bytes``, ...)."""
    spec, device, setup = _estimate_inputs("advise", model, keywords)
    if not isinstance(device, str):
        raise TypeError(f"device must be a str such as 'cuda', got {type(device).__name__} {device!r}")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device {device!r} is not accepted; accepted: 'cuda', 'cpu'")
    # As the command line's --advise: advice is for the GPU, on its own CUDA profile, whatever ``device`` says.
    given, items = _C.advise(spec, gpu, **setup)
    out = AdviceList()
    for a in items:
        breakdown = Breakdown(**dict(a["items"]), peak_phase=a["peak_phase"], **a["off_device"],
                              notes=_notes_of(spec))
        out.append(Advice(description=a["description"], options=a["options"], changes=a["changes"],
                          keeps_numerics=a["keeps_numerics"], cost=a["cost"], saved_bytes=a["saved_bytes"],
                          fits=a["fits"], total_bytes=a["total_bytes"],
                          total_high_bytes=a["total_high_bytes"], headroom_bytes=a["headroom_bytes"],
                          breakdown=breakdown, setup={**setup, **a["setup"]}))
    for name, value in given.items():
        setattr(out, name, value)
    return out
