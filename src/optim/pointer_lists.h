#pragma once
// Raw data pointers of tensor lists for the multi-tensor CUDA launchers (kernels/multi_tensor.cuh).
#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include "amp_kernels.h"

namespace gpuops::optim::detail {

// Raw data pointers of `rows` (one tensor list per row of the launch table), and the element counts.
template <size_t N>
inline std::vector<int64_t> pointer_lists(std::vector<void*> (&lists)[N], const std::array<at::TensorList, N>& rows) {
  for (size_t k = 0; k < N; ++k)
    for (const at::Tensor& t : rows[k]) lists[k].push_back(t.data_ptr());
  std::vector<int64_t> numel;
  for (const at::Tensor& t : rows[0]) numel.push_back(t.numel());
  return numel;
}

/// The device scalars of a step (null where not given).
inline kernels::StepScalars step_scalars(const std::optional<at::Tensor>& grad_scale,
                                         const std::optional<at::Tensor>& found_inf,
                                         const std::optional<at::Tensor>& lr) {
  auto pointer = [](const std::optional<at::Tensor>& t) -> const float* { return t ? t->data_ptr<float>() : nullptr; };
  return {pointer(grad_scale), pointer(found_inf), pointer(lr)};
}

}  // namespace gpuops::optim::detail
