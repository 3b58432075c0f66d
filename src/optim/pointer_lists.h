#pragma once
// Raw data pointers of tensor lists for the multi-tensor CUDA launchers (kernels/multi_tensor.cuh).
#include <array>
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

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

}  // namespace gpuops::optim::detail
