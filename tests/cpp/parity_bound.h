#pragma once
// Multi-step parity against a single-process reference, with a bound derived where the test runs (issue 31):
// ours must lie within kNoiseFactor times the distance between two equally valid float32 references (another
// order of the same float32 sums), floored at two float32 ulps. Both distances come from the order of float32
// sums, amplified over the steps; that order depends on the CPU's matmul blocking, so a fixed bound tuned on
// one CPU fails on another (2.45e-6 against 1e-6 on an AMD EPYC). A wrong step is 1e-3 or more.
#include <algorithm>
#include <vector>

#include <ATen/ATen.h>

namespace gpuops_test {

constexpr double kNoiseFactor = 10, kTwoUlps = 2.4e-7;

/// Largest absolute difference, relative to the reference tensor's largest magnitude, in float64.
inline double max_rel_error(const at::Tensor& a, const at::Tensor& ref) {
  return (a.to(at::kDouble) - ref.to(at::kDouble)).abs().max().item<double>() /
         ref.to(at::kDouble).abs().max().item<double>();
}

struct Parity {
  double worst = 0;  ///< ours from the reference
  double noise = 0;  ///< the other valid reference from the reference
  double bound() const { return kNoiseFactor * std::max(noise, kTwoUlps); }
  bool holds() const { return worst <= bound(); }
};

/// Over every tensor: ours and `other` against `ref`.
inline Parity parity(const std::vector<at::Tensor>& ours, const std::vector<at::Tensor>& ref,
                     const std::vector<at::Tensor>& other) {
  Parity p;
  for (size_t i = 0; i < ref.size(); ++i) {
    p.worst = std::max(p.worst, max_rel_error(ours[i], ref[i]));
    p.noise = std::max(p.noise, max_rel_error(other[i], ref[i]));
  }
  return p;
}

}  // namespace gpuops_test
