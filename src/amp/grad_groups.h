#pragma once
// Gradients grouped by dtype for the CUDA launchers (one multi-tensor launch per dtype).
#ifdef GPUOPS_WITH_CUDA
#include <map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include "amp_kernels.h"

namespace gpuops::amp::detail {

struct GradGroup {
  std::vector<void*> data;
  std::vector<int64_t> numel;
};

inline kernels::GradDtype grad_dtype(at::ScalarType t) {
  if (t == at::kHalf) return kernels::GradDtype::Float16;
  if (t == at::kBFloat16) return kernels::GradDtype::BFloat16;
  return kernels::GradDtype::Float32;
}

inline std::map<at::ScalarType, GradGroup> group_by_dtype(at::TensorList grads) {
  std::map<at::ScalarType, GradGroup> groups;
  for (const auto& g : grads) {
    auto& group = groups[g.scalar_type()];
    group.data.push_back(g.data_ptr());
    group.numel.push_back(g.numel());
  }
  return groups;
}

}  // namespace gpuops::amp::detail
#endif
