// unscale_and_check_: argument checks, then the CPU loop or the CUDA multi-tensor launcher.
#include <atomic>
#include <map>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "amp_checks.h"
#include "gpuops/amp.h"
#include "math/amp_math.h"

#ifdef GPUOPS_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "amp_kernels.h"
#endif

namespace gpuops::amp {
namespace {

void check_grads(at::TensorList grads, const at::Device& device) {
  for (size_t i = 0; i < grads.size(); ++i) {
    const auto& g = grads[i];
    TORCH_CHECK_VALUE(g.defined(), "unscale_and_check_: grads[", i, "] is undefined");
    TORCH_CHECK_VALUE(g.layout() == at::kStrided, "unscale_and_check_: grads[", i,
                      "] is sparse; only dense gradients can be unscaled (use a dense embedding gradient)");
    TORCH_CHECK_VALUE(g.scalar_type() == at::kFloat || g.scalar_type() == at::kHalf || g.scalar_type() == at::kBFloat16,
                      "unscale_and_check_: grads[", i, "] has dtype ", g.scalar_type(),
                      "; accepted: float32, float16, bfloat16");
    TORCH_CHECK_VALUE(g.device() == device, "unscale_and_check_: grads[", i, "] is on ", g.device(),
                      " but found_inf is on ", device, "; all gradients must share one device");
    TORCH_CHECK_VALUE(g.is_contiguous(), "unscale_and_check_: grads[", i, "] must be contiguous");
  }
}

void unscale_cpu(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  const float inv = inv_scale.item<float>();  // CPU tensor: a plain read, not a device sync
  std::atomic<bool> any_inf{false};
  for (const auto& g : grads) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "unscale_and_check_", [&] {
      scalar_t* data = g.data_ptr<scalar_t>();
      at::parallel_for(0, g.numel(), 1 << 15, [&](int64_t begin, int64_t end) {
        bool local = false;
        for (int64_t i = begin; i < end; ++i) {
          data[i] = static_cast<scalar_t>(math::unscale_element(static_cast<float>(data[i]), inv, local));
        }
        if (local) any_inf.store(true, std::memory_order_relaxed);
      });
    });
  }
  if (any_inf.load()) found_inf.fill_(1.0f);
}

#ifdef GPUOPS_WITH_CUDA
kernels::GradDtype grad_dtype(at::ScalarType t) {
  if (t == at::kHalf) return kernels::GradDtype::Float16;
  if (t == at::kBFloat16) return kernels::GradDtype::BFloat16;
  return kernels::GradDtype::Float32;
}

void unscale_cuda(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  c10::cuda::CUDAGuard guard(found_inf.device());
  std::map<at::ScalarType, std::pair<std::vector<void*>, std::vector<int64_t>>> by_dtype;
  for (const auto& g : grads) {
    auto& group = by_dtype[g.scalar_type()];
    group.first.push_back(g.data_ptr());
    group.second.push_back(g.numel());
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  for (const auto& [dtype, group] : by_dtype) {
    kernels::launch_unscale_and_check(group.first, group.second, grad_dtype(dtype), inv_scale.data_ptr<float>(),
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
  check_grads(grads, device);
  if (device.is_cpu()) return unscale_cpu(grads, found_inf, inv_scale);
#ifdef GPUOPS_WITH_CUDA
  if (device.is_cuda()) return unscale_cuda(grads, found_inf, inv_scale);
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
