"""gpuops: a training runtime for LibTorch and PyTorch.

Mixed precision, activation checkpointing, gradient accumulation, a sharded optimizer, an OOM-safe
batch-size search and a VRAM estimator. ``import gpuops`` loads torch first: the extension links
against the same LibTorch.
"""

import os as _os

import torch as _torch  # noqa: F401  (loads libtorch before our extension)

from . import _C
from . import optim
from . import dist  # the communicator (gpuops.dist.Communicator)
from . import metrics  # training telemetry (gpuops.metrics.Recorder)
from ._C import DeviceInfo, FlatParams, MemoryStats, device_info
from .memory import memory_budget
from .accumulate import GradAccumulator
from .amp import GradScaler, clip_grad_norm_
from .batch_size import find_max_batch_size, profile_memory
from .checkpointing import apply_checkpointing, checkpoint, remove_checkpointing
from .activation_offload import ActivationPlan, OffloadedActivations, apply_activation_policy, offload_activations
from .estimator import Breakdown, EstimateWarning, GpuFit, estimate, fit_table, gpu_catalog, presets
from .estimator import Advice, advise, estimate_svg, plot_estimate  # pictures and advice
from .training_state import TrainingState
from .zero import ZeroOptimizer  # the sharded optimizer (issue 13, part 2)

__version__ = "0.1.0"

#: Folder to add to CMAKE_PREFIX_PATH so that ``find_package(gpuops CONFIG)`` finds this install.
cmake_prefix_path = _os.path.dirname(_os.path.abspath(__file__))

__all__ = [
    "Advice",
    "advise",
    "estimate_svg",
    "plot_estimate",
    "Breakdown",
    "EstimateWarning",
    "GradScaler",
    "apply_checkpointing",
    "checkpoint",
    "remove_checkpointing",
    "offload_activations",
    "OffloadedActivations",
    "apply_activation_policy",
    "ActivationPlan",
    "DeviceInfo",
    "FlatParams",
    "GradAccumulator",
    "MemoryStats",
    "TrainingState",
    "ZeroOptimizer",
    "clip_grad_norm_",
    "cmake_prefix_path",
    "device_info",
    "estimate",
    "fit_table",
    "GpuFit",
    "find_max_batch_size",
    "profile_memory",
    "gpu_catalog",
    "memory_budget",
    "presets",
]
