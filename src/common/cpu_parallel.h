#pragma once
// at::parallel_for for the CPU loops. In torch's OpenMP builds it is inline header code that runs serially
// unless this file is compiled with -fopenmp (cmake/GpuopsOpenMP.cmake): fail the build, not the speed.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/Config.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error "gpuops' CPU loops need -fopenmp with this torch build, or at::parallel_for runs on one thread"
#endif

namespace gpuops::cpu {

/// Runs body(piece, t, begin, end) over [0, numel) of every tensor t, cut into pieces of at most
/// `piece_size` elements numbered in order (the same numbering whatever the thread count), all in ONE
/// parallel region: a region per tensor wakes the thread team once per tensor, which dominated steps over
/// many small tensors. Threads take equal counts of consecutive pieces; small work runs on the caller.
template <typename Body>
void for_each_piece(at::TensorList tensors, int64_t piece_size, const Body& body) {
  std::vector<std::pair<size_t, int64_t>> pieces;  // (tensor, first element)
  int64_t total = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const int64_t n = tensors[t].numel();
    total += n;
    for (int64_t begin = 0; begin < n; begin += piece_size) pieces.emplace_back(t, begin);
  }
  auto run = [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const auto [t, begin] = pieces[i];
      body(i, t, begin, std::min(begin + piece_size, tensors[t].numel()));
    }
  };
  const auto count = static_cast<int64_t>(pieces.size());
  if (total <= piece_size) {
    run(0, count);
  } else {
    at::parallel_for(0, count, 1, run);
  }
}

/// An optimizer's CPU step: unless *found_inf is set, makes each tensor's per-step constants with
/// make(step counter, gradient factor), runs body(t, begin, end, constants of t) over the pieces of every
/// tensor in one parallel region, then advances the step counters. CPU tensors: these reads are plain
/// loads, not device-to-host copies.
template <typename Make, typename Body>
void for_each_applied_piece(at::TensorList tensors, at::TensorList steps, const std::optional<at::Tensor>& grad_scale,
                            const std::optional<at::Tensor>& found_inf, const Make& make, const Body& body) {
  if (found_inf && *found_inf->data_ptr<float>() != 0.0f) return;
  const float factor = grad_scale ? 1.0f / *grad_scale->data_ptr<float>() : 1.0f;
  std::vector<decltype(make(0.0f, factor))> constants;
  for (const at::Tensor& step : steps) constants.push_back(make(*step.data_ptr<float>(), factor));
  for_each_piece(tensors, 1 << 15, [&](int64_t, size_t t, int64_t begin, int64_t end) {
    body(t, begin, end, constants[t]);
  });
  for (const at::Tensor& step : steps) *step.data_ptr<float>() += 1.0f;
}

}  // namespace gpuops::cpu
