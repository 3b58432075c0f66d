// unscale_and_check_: argument checks, then the CPU loop or the CUDA multi-tensor launcher.
#include <atomic>
#include <cmath>
#include <type_traits>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>

#include "../common/cpu_parallel.h"
#include "amp_checks.h"
#include "gpuops/amp.h"
#include "math/amp_math.h"
#include "math/float8.h"

#ifdef GPUOPS_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "grad_groups.h"
#endif

namespace gpuops::amp {
namespace {

// float32 elements, 8 at a time (float8.h): the element loop with its compare-and-set flag ran at a quarter
// of torch's speed. g * inv is what unscale_element computes (multiplying by 1 is exact); g - g is 0 for a
// finite g and NaN otherwise, so a non-zero "poison" sum flags exactly the non-finite inputs.
__attribute__((target_clones("avx512f", "avx2", "default"))) bool unscale_float_range(float* __restrict data,
                                                                                     int64_t n, float inv) {
  math::Float8 poison = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const math::Float8 g = math::load8(data + i);
    poison += g - g;
    math::store8(data + i, g * inv);
  }
  float poisoned = 0.0f;
  for (; i < n; ++i) {
    poisoned += data[i] - data[i];
    data[i] *= inv;
  }
  for (int k = 0; k < 8; ++k) poisoned += poison[k];
  return poisoned != 0.0f;  // NaN != 0
}

void unscale_cpu(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  const float inv = inv_scale.item<float>();  // CPU tensor: a plain read, not a device sync
  std::atomic<bool> any_inf{false};
  cpu::for_each_piece(grads, 1 << 15, [&](int64_t, size_t t, int64_t begin, int64_t end) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grads[t].scalar_type(), "unscale_and_check_", [&] {
      scalar_t* data = grads[t].data_ptr<scalar_t>();
      bool local = false;
      if constexpr (std::is_same_v<scalar_t, float>) {
        // (compiled for every dtype, taken for float32 only)
        local = unscale_float_range(reinterpret_cast<float*>(data) + begin, end - begin, inv);
      } else {
        for (int64_t i = begin; i < end; ++i) {
          data[i] = static_cast<scalar_t>(math::unscale_element(static_cast<float>(data[i]), inv, local));
        }
      }
      if (local) any_inf.store(true, std::memory_order_relaxed);
    });
  });
  // A non-finite inv_scale makes finite gradients inf/nan: the step must be skipped as for an overflow.
  if (any_inf.load() || !std::isfinite(inv)) found_inf.fill_(1.0f);
}

#ifdef GPUOPS_WITH_CUDA
void unscale_cuda(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  c10::cuda::CUDAGuard guard(found_inf.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  for (const auto& [dtype, group] : detail::group_by_dtype(grads)) {
    kernels::launch_unscale_and_check(group.data, group.numel, detail::grad_dtype(dtype), inv_scale.data_ptr<float>(),
                                      found_inf.data_ptr<float>(), stream);
  }
}
#endif

}  // namespace

void unscale_and_check_(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  TORCH_CHECK_VALUE(found_inf.defined(), "unscale_and_check_: found_inf is undefined");
  const at::Device device = found_inf.device();
  detail::check_scalar_state(found_inf, "found_inf", at::kFloat, device);
  detail::check_scalar_state(inv_scale, "inv_scale", at::kFloat, device);
  detail::check_grads("unscale_and_check_", grads, device, /*any_view=*/true);
  // The linear passes take dense float32/16/bf16 gradients; a strided view (a slice) or float64 goes to
  // torch's own kernel, which handles any layout, as torch's scaler does for every gradient.
  std::vector<at::Tensor> linear, others;
  for (const auto& g : grads)
    (g.is_non_overlapping_and_dense() && g.scalar_type() != at::kDouble ? linear : others).push_back(g);
  if (!others.empty()) {
    TORCH_CHECK_VALUE(device.is_cpu() || device.is_cuda(), "unscale_and_check_: device ", device, " is not supported");
    at::_amp_foreach_non_finite_check_and_unscale_(others, const_cast<at::Tensor&>(found_inf), inv_scale);
  }
  if (linear.empty()) return;
  if (device.is_cpu()) return unscale_cpu(linear, found_inf, inv_scale);
#ifdef GPUOPS_WITH_CUDA
  if (device.is_cuda()) return unscale_cuda(linear, found_inf, inv_scale);
#endif
  TORCH_CHECK_VALUE(false, "unscale_and_check_: device ", device, " is not supported; accepted: cpu",
#ifdef GPUOPS_WITH_CUDA
                    ", cuda"
#else
                    " (this build has no CUDA)"
#endif
  );
}

}  // namespace gpuops::amp
