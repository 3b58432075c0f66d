// sgd_step_: argument checks, then the CPU loop or the CUDA multi-tensor launcher (same element math).
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "gpuops/fused_sgd.h"
#include "math/sgd_math.h"
#include "optim_checks.h"

#ifdef GPUOPS_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "sgd_kernels.h"
#endif

namespace gpuops::optim {
namespace {

void check_options(const SgdOptions& o) {
  TORCH_CHECK_VALUE(o.lr >= 0.0, "sgd_step_: lr must be >= 0, got ", o.lr);
  TORCH_CHECK_VALUE(o.momentum >= 0.0, "sgd_step_: momentum must be >= 0, got ", o.momentum);
  TORCH_CHECK_VALUE(o.weight_decay >= 0.0, "sgd_step_: weight_decay must be >= 0, got ", o.weight_decay);
  TORCH_CHECK_VALUE(!o.nesterov || (o.momentum > 0.0 && o.dampening == 0.0),
                    "sgd_step_: nesterov needs momentum > 0 and dampening = 0, got momentum=", o.momentum,
                    ", dampening=", o.dampening);
}

math::SgdHyper to_hyper(const SgdOptions& o) {
  return {o.lr, o.momentum, o.dampening, o.weight_decay, o.nesterov, o.maximize};
}

void sgd_cpu(at::TensorList params, at::TensorList grads, at::TensorList buffers, at::TensorList steps,
             const SgdOptions& options, const std::optional<at::Tensor>& grad_scale,
             const std::optional<at::Tensor>& found_inf) {
  // CPU tensors: these reads are plain loads, not device-to-host copies.
  if (found_inf && *found_inf->data_ptr<float>() != 0.0f) return;
  const float factor = grad_scale ? 1.0f / *grad_scale->data_ptr<float>() : 1.0f;
  const math::SgdHyper hyper = to_hyper(options);
  for (size_t t = 0; t < params.size(); ++t) {
    float* step = steps[t].data_ptr<float>();
    const math::SgdStep s = math::make_sgd_step(hyper, *step == 0.0f, factor);
    float* param = params[t].data_ptr<float>();
    const float* grad = grads[t].data_ptr<float>();
    float* buf = options.momentum != 0.0 ? buffers[t].data_ptr<float>() : nullptr;
    at::parallel_for(0, params[t].numel(), 1 << 14, [&](int64_t begin, int64_t end) {
      float unused = 0.0f;
      for (int64_t i = begin; i < end; ++i) math::sgd_update(param[i], grad[i], buf ? buf[i] : unused, s);
    });
    *step += 1.0f;
  }
}

#ifdef GPUOPS_WITH_CUDA
void sgd_cuda(at::TensorList params, at::TensorList grads, at::TensorList buffers, at::TensorList steps,
              const SgdOptions& options, const std::optional<at::Tensor>& grad_scale,
              const std::optional<at::Tensor>& found_inf) {
  c10::cuda::CUDAGuard guard(params[0].device());
  std::vector<void*> lists[4];
  std::vector<int64_t> numel;
  for (size_t t = 0; t < params.size(); ++t) {
    lists[0].push_back(params[t].data_ptr());
    lists[1].push_back(grads[t].data_ptr());
    lists[2].push_back(options.momentum != 0.0 ? buffers[t].data_ptr() : params[t].data_ptr());
    lists[3].push_back(steps[t].data_ptr());
    numel.push_back(params[t].numel());
  }
  kernels::launch_sgd_step(lists, numel, to_hyper(options), grad_scale ? grad_scale->data_ptr<float>() : nullptr,
                           found_inf ? found_inf->data_ptr<float>() : nullptr, c10::cuda::getCurrentCUDAStream());
}
#endif

}  // namespace

void sgd_step_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, at::TensorList steps,
               const SgdOptions& options, const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf) {
  check_options(options);
  if (options.momentum != 0.0) {
    detail::check_step_lists("sgd_step_", params, {{"grads", grads}, {"momentum_buffers", momentum_buffers}}, steps,
                             grad_scale, found_inf);
  } else {
    detail::check_step_lists("sgd_step_", params, {{"grads", grads}}, steps, grad_scale, found_inf);
  }
  if (params.empty()) return;
  const at::Device device = params[0].device();
  if (device.is_cpu()) return sgd_cpu(params, grads, momentum_buffers, steps, options, grad_scale, found_inf);
#ifdef GPUOPS_WITH_CUDA
  if (device.is_cuda()) return sgd_cuda(params, grads, momentum_buffers, steps, options, grad_scale, found_inf);
#endif
  TORCH_CHECK_VALUE(false, "sgd_step_: device ", device, " is not supported");
}

}  // namespace gpuops::optim
