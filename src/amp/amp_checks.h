#pragma once
// Argument checks shared by the CPU and CUDA paths of the AMP ops.
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

}  // namespace gpuops::amp::detail
