#pragma once
// Activation checkpointing for LibTorch C++ (which has none: pytorch/pytorch issue 52744), reentrant
// design (design §9): the forward of a segment runs without grad and keeps only its inputs; the backward
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
};

/// Runs fn(inputs) keeping only `inputs` for the backward; returns its outputs (outputs that are not
/// floating point do not require grad). With grad mode off it simply runs fn. Errors (c10::ValueError):
/// no input requires grad (the parameters inside would get no gradient: make an input require grad);
/// and, in the backward, torch::autograd::grad with `inputs` (the reentrant design accumulates into
/// .grad: use backward()), or an input modified in place after the forward.
std::vector<at::Tensor> checkpoint(const SegmentFn& fn, const std::vector<at::Tensor>& inputs,
                                   const CheckpointOptions& options = {});

/// One tensor in, one out.
at::Tensor checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& input,
                      const CheckpointOptions& options = {});

}  // namespace gpuops
