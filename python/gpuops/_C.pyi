"""Type stubs of the native module gpuops._C (use the gpuops package rather than this module)."""

from typing import Callable, List, Optional, Sequence, Tuple

import torch

class DeviceInfo:
    type: str
    index: int
    name: str
    total_memory_bytes: int
    free_memory_bytes: int
    multiprocessors: int
    compute_capability: Tuple[int, int]
    visible_device_count: int
    cuda_visible_devices: str
    local_rank: Optional[int]

def device_info(index: Optional[int] = None) -> DeviceInfo: ...

class MemoryStats:
    current_bytes: int
    peak_bytes: int
    limit_bytes: int
    allocations: int
    failed_allocations: int

class MemoryBudget:
    def __init__(self, limit_bytes: Optional[int] = None, device: str = "cpu") -> None: ...
    def __enter__(self) -> "MemoryBudget": ...
    def __exit__(self, *args: object) -> None: ...
    def stats(self) -> MemoryStats: ...
    def reset_peak(self) -> None: ...
    @property
    def current_bytes(self) -> int: ...
    @property
    def peak_bytes(self) -> int: ...
    @property
    def limit_bytes(self) -> int: ...
    @property
    def device(self) -> str: ...
    @property
    def active(self) -> bool: ...

class ModelSpec:
    name: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    @property
    def parameter_count(self) -> int: ...

def model_from_preset(name: str) -> ModelSpec: ...
def model_from_config_json(json_text: str, name: str) -> ModelSpec: ...
def model_from_config_file(path: str) -> ModelSpec: ...
def model_from_params(count: str) -> ModelSpec: ...
def preset_names() -> List[str]: ...
def estimate_memory(model: ModelSpec, device: str, precision: str, amp: str, optimizer: str, optimizer_impl: str,
                    zero_stage: int, num_gpus: int, checkpointing: str, attention: str, lora_rank: int,
                    lora_targets: Sequence[str], base_dtype: str, micro_batch: int, seq_len: int,
                    grad_accum: int) -> Tuple[List[Tuple[str, int]], str]: ...
def gpu_catalog() -> List[dict]: ...
def run_cli(args: Sequence[str]) -> Tuple[int, str, str]: ...

def choose_for_budget(costs: list[tuple[str, int, int, float]], budget_bytes: int, units: int = 65536) -> list[int]: ...

class MemoryProfile:
    fixed_bytes: float
    per_sample_bytes: float
    points: list[tuple[int, int]]
    linear: bool
    note: str
    def predict(self, batch: int) -> int: ...
    def max_batch_for(self, bytes: int) -> int: ...

def fit_memory_profile(points: list[tuple[int, int]], tolerance: float = 0.05) -> MemoryProfile: ...

class BatchTrial:
    batch: int
    ok: bool
    peak_bytes: int
    seconds: float
    phase: str

class BatchSearchResult:
    max_batch: int
    recommended: int
    trials: list[BatchTrial]
    profile: MemoryProfile | None
    complete: bool
    from_cache: bool

class BatchSearchOptions:
    low: int
    high: int | None
    multiple_of: int
    margin: float
    profile_seed: bool
    seed: int | None
    headroom_bytes: int
    steps_per_trial: int
    max_trials: int
    max_seconds: float
    cache_file: str
    cache_key: str
    def __init__(self) -> None: ...

def search_max_batch(run: Callable[[int], tuple[bool, int, float]], options: BatchSearchOptions,
                     agree_min: Callable[[int], int] | None = None) -> BatchSearchResult: ...
def memory_headroom_bytes(device: str = "cpu") -> int: ...

def checkpoint_segment(fn: Callable[[list], list], inputs: list, preserve_rng_state: bool = True,
                       buffers: list = ...) -> list: ...

class FlatBucket:
    device: str
    data: "torch.Tensor"
    grad: "torch.Tensor"
    slots: list[tuple["torch.Tensor", int, int]]

class FlatParams:
    buckets: list[FlatBucket]
    def __init__(self, params: list, alignment_bytes: int = 16, world_size: int = 1) -> None: ...
    def flat_parameters(self) -> list["torch.Tensor"]: ...
    def zero_grad(self) -> None: ...
    def intact(self) -> bool: ...
    @staticmethod
    def shard(flat: "torch.Tensor", rank: int, world_size: int) -> "torch.Tensor": ...
CUDA_CONTEXT_BYTES: int
