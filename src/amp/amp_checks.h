#pragma once
// Argument checks shared by the CPU and CUDA paths of the AMP ops.
#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace gpuops::amp::detail {

inline void check_scalar_state(const at::Tensor& t, const char* name, at::ScalarType dtype, const at::Device& device) {
  TORCH_CHECK_VALUE(t.defined() && t.numel() == 1 && t.scalar_type() == dtype, name, " must be a one-element ",
                    c10::toString(dtype), " tensor, got ", t.defined() ? t.toString() : "undefined", " with ",
                    t.defined() ? t.numel() : 0, " elements");
  TORCH_CHECK_VALUE(t.device() == device, name, " must be on ", device, " like the other state, got ", t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
}

/// Gradients an AMP op can read: defined, dense and non-overlapping (contiguous, channels_last, transposed:
/// the ops go over the memory block linearly) float32/float16/bfloat16, all on `device`. `any_view`: also
/// strided views (a slice) and float64, which the op hands to torch's own kernel; never overlapping
/// memory (an expanded view), which no in-place write can take (torch refuses it too).
inline void check_grads(const char* op, at::TensorList grads, const at::Device& device, bool any_view = false) {
  for (size_t i = 0; i < grads.size(); ++i) {
    const auto& g = grads[i];
    TORCH_CHECK_VALUE(g.defined(), op, ": grads[", i, "] is undefined");
    TORCH_CHECK_VALUE(g.layout() == at::kStrided, op, ": grads[", i,
                      "] is sparse; only dense gradients are supported (use a dense embedding gradient)");
    const bool dtype_ok = g.scalar_type() == at::kFloat || g.scalar_type() == at::kHalf ||
                          g.scalar_type() == at::kBFloat16 || (any_view && g.scalar_type() == at::kDouble);
    TORCH_CHECK_VALUE(dtype_ok, op, ": grads[", i, "] has dtype ", g.scalar_type(), "; accepted: float32, float16, "
                      "bfloat16", any_view ? ", float64" : "");
    TORCH_CHECK_VALUE(g.device() == device, op, ": grads[", i, "] is on ", g.device(), " but found_inf is on ",
                      device, "; all gradients must share one device");
    if (any_view) {
      TORCH_CHECK_VALUE(at::has_internal_overlap(g) != at::MemOverlap::Yes, op, ": grads[", i, "] has elements "
                        "sharing memory (an expanded view, strides ", g.strides(), " for sizes ", g.sizes(), "), which "
                        "cannot be written in place; clone() it first");
    } else {
      TORCH_CHECK_VALUE(g.is_non_overlapping_and_dense(), op, ": grads[", i, "] must be dense and non-overlapping "
                        "(e.g. contiguous or channels_last), got strides ", g.strides(), " for sizes ", g.sizes());
    }
  }
}

}  // namespace gpuops::amp::detail
