"""The VRAM estimator: peak memory of a training step, before launching it (the `gpuops estimate` engine)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Mapping, Optional, Sequence, Union

from . import _C


@dataclass(frozen=True)
class Breakdown:
    """Bytes per category at the peak of one training step on one device, and the moment of that peak
    (``peak_phase``: loss-backward, attention-backward, backward-end or optimizer-step)."""

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

    def byte_items(self) -> dict:
        """The categories and their bytes (everything but peak_phase)."""
        return {k: v for k, v in asdict(self).items() if k != "peak_phase"}

    @property
    def total_bytes(self) -> int:
        return sum(self.byte_items().values())

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total_bytes}


def _model_spec(model, config, params) -> _C.ModelSpec:
    given = [x is not None for x in (model, config, params)]
    if sum(given) != 1:
        raise ValueError("estimate: give exactly one of model (a preset name), config (a config.json path or dict) "
                         f"or params (a parameter count); got {sum(given)}")
    if model is not None:
        return _C.model_from_preset(model)
    if params is not None:
        return _C.model_from_params(params)
    if isinstance(config, Mapping):
        try:
            text = json.dumps(dict(config), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise type(e)(f"config: the dict is not a JSON document ({e}); give the fields of a config.json") from None
        return _C.model_from_config_json(text, "config")
    if not isinstance(config, (str, bytes, os.PathLike)):
        raise TypeError(f"config must be a path or a dict, got {type(config).__name__} {config!r}")
    return _C.model_from_config_file(os.fsencode(config))  # bytes: any file name reaches open()


def estimate(
    model: Optional[str] = None,
    *,
    config: Union[str, os.PathLike, Mapping, None] = None,
    params: Union[int, str, None] = None,
    precision: str = "bf16-mixed",
    amp: str = "autocast",
    optimizer: str = "adamw",
    optimizer_impl: str = "default",
    zero_stage: int = 0,
    num_gpus: int = 1,
    checkpointing: str = "none",
    attention: str = "sdpa",
    lora_rank: int = 0,
    lora_targets: Sequence[str] = ("q", "v"),
    base_dtype: str = "bf16",
    micro_batch: int = 1,
    seq_len: int = 512,
    grad_accum: int = 1,
    device: str = "cuda",
) -> Breakdown:
    """Peak memory of one training step, per GPU (``device="cuda"``) or on the CPU (``device="cpu"``).

    The architecture is a preset name (``gpuops.presets()``), a Hugging Face ``config.json`` (path or
    dict) or a bare parameter count (``7_000_000_000`` or ``"7B"``). The options are those of
    ``gpuops estimate``; a value of the wrong type raises ``TypeError`` and a bad value ``ValueError``, each
    naming the argument (integers must be ints: ``micro_batch=2.5`` or ``"2"`` is a TypeError; a setup whose
    bytes would pass 2**63 is a ValueError naming the size that is too large). ``lora_targets`` is a sequence
    of names or one comma list (``"q,v"``). ``amp`` says where mixed
    precision keeps its weights: ``"autocast"`` (torch.autocast: fp32 weights) or ``"master-copy"`` (16-bit
    weights and an fp32 master copy); ``optimizer_impl`` is ``"default"`` (torch's for the device),
    ``"for-loop"``, ``"foreach"`` or ``"fused"``.
    """
    spec = _model_spec(model, config, params)
    # Types and ranges are checked in C++ (gpuops._C), each error naming its argument.
    items, phase = _C.estimate_memory(
        spec, device, precision=precision, amp=amp, optimizer=optimizer, optimizer_impl=optimizer_impl,
        zero_stage=zero_stage, num_gpus=num_gpus, checkpointing=checkpointing, attention=attention,
        lora_rank=lora_rank, lora_targets=lora_targets, base_dtype=base_dtype, micro_batch=micro_batch,
        seq_len=seq_len, grad_accum=grad_accum)
    return Breakdown(**dict(items), peak_phase=phase)


def presets() -> list:
    """Names of the built-in architectures."""
    return _C.preset_names()


def gpu_catalog() -> list:
    """The GPU models the estimator knows: memory, bandwidth, bf16 rate and a typical spot price."""
    return _C.gpu_catalog()
