#pragma once
// Activation checkpointing for LibTorch C++ (which has none: pytorch/pytorch issue 52744), reentrant
// design: the forward of a segment runs without grad and keeps only its inputs; the backward
// restores the RNG states (CPU and every CUDA device, not touching streams) and the autocast state of the
// forward, recomputes the segment with grad and back-propagates through it.

#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>

namespace gpuops {

/// A checkpointed segment: tensors in, tensors out. Non-tensor arguments are captured by the function.
using SegmentFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

struct CheckpointOptions {
  bool preserve_rng_state = true;  ///< replay dropout and other random ops exactly in the recomputation
  /// Buffers the segment updates in place (e.g. BatchNorm running statistics): restored after the
  /// recomputation, so they are updated once per step, not twice.
  std::vector<at::Tensor> buffers;
  /// Offloaded checkpointing (issue 33, Unsloth's "offloaded gradient checkpointing"): the inputs the segment
  /// keeps go to host memory (pinned when they are on a GPU, copied asynchronously) instead of staying on their
  /// device, and come back at the start of the segment's backward. The device then holds neither the segment's
  /// activations nor its inputs between forward and backward. Host copies are outside any MemoryBudget; an
  /// input changed in place after the forward is still refused (its version is kept).
  bool offload_inputs = false;
};

/// Runs fn(inputs) keeping only `inputs` for the backward; returns its outputs (outputs that are not
/// floating point do not require grad). With grad mode off it simply runs fn; with no input requiring grad
/// it warns and runs fn without grad (as torch's reentrant checkpoint: its outputs need no grad). Errors in
/// the backward: torch::autograd::grad with `inputs` (c10::ValueError: the reentrant design accumulates into
/// .grad: use backward()); no recomputed output requires grad, a second backward without retain_graph, or an
/// input modified in place after the forward (c10::Error, as torch).
std::vector<at::Tensor> checkpoint(const SegmentFn& fn, const std::vector<at::Tensor>& inputs,
                                   const CheckpointOptions& options = {});

/// One tensor in, one out.
at::Tensor checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& input,
                      const CheckpointOptions& options = {});

}  // namespace gpuops
