#pragma once
// Adam/AdamW with block-wise 8-bit states (issue 32): the fused step over lists of tensors
// (torch.ops.gpuops.adam8_step_), and the quantisation it stores its states with.
#include <optional>
#include <string_view>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include "gpuops/fused_adam.h"

namespace gpuops::optim {

/// Elements per scale of an 8-bit state.
inline constexpr int64_t kStateBlock = 256;
/// Parameters with fewer elements keep float32 states (bitsandbytes' default threshold): their states cost
/// little, and a block's scale is then a large share of them.
inline constexpr int64_t kMin8BitNumel = 4096;

/// What an 8-bit state's codes mean (the code books and the block size), saved with it: a state of another
/// format is refused at load, not decoded with the wrong book.
inline constexpr const char* kStateFormat = "dynamic8-block256-v1";

/// The number of scales of an 8-bit state of `numel` elements: one per block of kStateBlock.
inline int64_t state_blocks(int64_t numel) { return (numel + kStateBlock - 1) / kStateBlock; }

/// The names of an 8-bit state's tensors: "<moment>_codes" (uint8, one per element) and "<moment>_scales"
/// (float32, one per block), as state_dicts and shard files hold them.
inline bool is_state_codes(std::string_view name) { return name.size() > 6 && name.substr(name.size() - 6) == "_codes"; }
inline bool is_state_scales(std::string_view name) {
  return name.size() > 7 && name.substr(name.size() - 7) == "_scales";
}

/// `values` (float32, dense, any layout: blocks run over its memory order) quantised into `codes` (uint8,
/// laid out as values) and `scales` (float32, state_blocks(numel) elements), with the signed code book (first
/// moments) or the unsigned one (second moments: values must be >= 0, else c10::ValueError).
void quantize_state_(const at::Tensor& values, const at::Tensor& codes, const at::Tensor& scales, bool is_signed);
/// The float32 values of codes and scales (laid out as codes).
at::Tensor dequantize_state(const at::Tensor& codes, const at::Tensor& scales, bool is_signed);

/// One Adam/AdamW step with 8-bit moments, in one pass per block: the gradient read once (divided by
/// *grad_scale), each moment decoded, updated in float32, the parameter written (and rounded into its 16-bit
/// copy), then the moments re-encoded with the block's new scale. params are float32 (master_params empty) or
/// float16/bfloat16 with float32 master_params; exp_avg_codes / exp_avg_sq_codes uint8 laid out as the
/// parameters; exp_avg_scales / exp_avg_sq_scales float32, state_blocks(numel) each. found_inf non-zero: nothing
/// changes, not even the steps. amsgrad is refused. Bad arguments raise c10::ValueError before anything is
/// written. The CPU loop and the CUDA kernel give the same bits.
void adam8_step_(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                 at::TensorList exp_avg_codes, at::TensorList exp_avg_scales, at::TensorList exp_avg_sq_codes,
                 at::TensorList exp_avg_sq_scales, at::TensorList steps, const AdamStepOptions& options,
                 const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf);

}  // namespace gpuops::optim
