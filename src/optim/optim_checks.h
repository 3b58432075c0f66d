#pragma once
// Argument checks shared by the fused optimizer steps: every list matches params element by element.
#include <cstring>
#include <initializer_list>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

namespace gpuops::optim::detail {

using NamedList = std::pair<const char*, at::TensorList>;

/// params: dense, non-overlapping float32 on one device (contiguous, channels_last or transposed: the step
/// goes over the memory block linearly); each named list: same length, dtype, device, shape and strides;
/// steps: one-element float32 counters; grad_scale, found_inf, lr: optional one-element float32 tensors.
inline void check_step_lists(const char* op, at::TensorList params, std::initializer_list<NamedList> like_params,
                             at::TensorList steps, const std::optional<at::Tensor>& grad_scale,
                             const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& lr) {
  const size_t n = params.size();
  for (const auto& [name, list] : like_params) {
    TORCH_CHECK_VALUE(list.size() == n, op, ": ", name, " has ", list.size(), " tensors but params has ", n);
  }
  TORCH_CHECK_VALUE(steps.size() == n, op, ": steps has ", steps.size(), " tensors but params has ", n);
  if (n == 0) return;
  TORCH_CHECK_VALUE(params[0].defined(), op, ": params[0] must be a dense tensor, got an undefined one");
  const at::Device device = params[0].device();
  auto check = [&](const at::Tensor& t, const at::Tensor& param, const std::string& name, size_t i) {
    TORCH_CHECK_VALUE(t.defined() && t.layout() == at::kStrided, op, ": ", name, "[", i, "] must be a dense tensor",
                      name == "grads" ? " (sparse gradients are not supported)" : "");
    TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat, op, ": ", name, "[", i, "] has dtype ", t.scalar_type(),
                      "; accepted: float32");
    TORCH_CHECK_VALUE(t.device() == device, op, ": ", name, "[", i, "] is on ", t.device(), " but params[0] is on ",
                      device, "; one call takes one device");
    const bool laid_out_alike =
        t.is_non_overlapping_and_dense() && t.sizes() == param.sizes() && t.strides() == param.strides();
    TORCH_CHECK_VALUE(laid_out_alike, op, ": ", name, "[", i, "] must be dense and non-overlapping with the sizes ",
                      "and strides of params[", i, "] ", param.sizes(), " / ", param.strides(), ", got ", t.sizes(),
                      " / ", t.strides());
  };
  for (size_t i = 0; i < n; ++i) {
    check(params[i], params[i], "params", i);
    for (const auto& [name, list] : like_params) check(list[i], params[i], name, i);
    TORCH_CHECK_VALUE(steps[i].defined() && steps[i].numel() == 1 && steps[i].scalar_type() == at::kFloat &&
                          steps[i].device() == device,
                      op, ": steps[", i, "] must be a one-element float32 tensor on ", device);
  }
  for (const auto& [name, t] : {std::make_pair("grad_scale", &grad_scale), std::make_pair("found_inf", &found_inf),
                                std::make_pair("lr", &lr)}) {
    if (!*t) continue;
    const at::Tensor& value = **t;
    TORCH_CHECK_VALUE(value.defined() && value.numel() == 1 && value.scalar_type() == at::kFloat &&
                          value.device() == device,
                      op, ": ", name, " must be a one-element float32 tensor on ", device, ", got ",
                      value.defined() ? value.toString() + " on " + value.device().str() : "an undefined tensor");
  }
  // Every tensor the step writes once: the same memory twice (a parameter listed twice, two states sharing a
  // buffer) would be updated twice in one call.
  std::unordered_map<const void*, std::pair<const char*, size_t>> written;
  auto claim = [&](const at::Tensor& t, const char* name, size_t i) {
    if (t.numel() == 0) return;  // owns no memory
    const auto [seen, fresh] = written.emplace(t.data_ptr(), std::make_pair(name, i));
    TORCH_CHECK_VALUE(fresh, op, ": ", name, "[", i, "] is the memory of ", seen->second.first, "[",
                      seen->second.second, "]; each tensor the step writes must be given once");
  };
  for (size_t i = 0; i < n; ++i) {
    claim(params[i], "params", i);
    claim(steps[i], "steps", i);
    for (const auto& [name, list] : like_params)
      if (std::strcmp(name, "grads") != 0) claim(list[i], name, i);  // gradients are only read
  }
}

/// The 16-bit side of a master-copy step (the float32 side goes through check_step_lists): params float16
/// or bfloat16, all one dtype; grads of that dtype; both dense, non-overlapping, laid out and placed like masters.
inline void check_half_lists(const char* op, at::TensorList params, at::TensorList grads, at::TensorList masters) {
  TORCH_CHECK_VALUE(params.size() == masters.size() && grads.size() == masters.size(), op, ": params (",
                    params.size(), "), grads (", grads.size(), ") and master_params (", masters.size(),
                    ") must have the same length");
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK_VALUE(params[i].defined() && grads[i].defined(), op, ": ", params[i].defined() ? "grads[" : "params[",
                      i, "] is undefined");
    const auto dtype = params[i].scalar_type();
    TORCH_CHECK_VALUE(dtype == at::kHalf || dtype == at::kBFloat16, op, ": params[", i, "] has dtype ", dtype,
                      "; accepted: float16 or bfloat16 (float32 parameters take the plain step)");
    TORCH_CHECK_VALUE(dtype == params[0].scalar_type(), op, ": params[", i, "] is ", dtype, " but params[0] is ",
                      params[0].scalar_type(), "; one call takes one dtype");
    for (const auto& [name, t] : {std::make_pair("params", params[i]), std::make_pair("grads", grads[i])}) {
      TORCH_CHECK_VALUE(t.defined() && t.layout() == at::kStrided && t.is_non_overlapping_and_dense() &&
                            t.strides() == masters[i].strides(),
                        op, ": ", name, "[", i, "] must be dense and non-overlapping with the strides of ",
                        "master_params[", i, "] ", masters[i].strides(), ", got ", t.strides());
      TORCH_CHECK_VALUE(t.scalar_type() == dtype, op, ": ", name, "[", i, "] has dtype ", t.scalar_type(),
                        "; accepted: the dtype of params[", i, "], ", dtype);
      TORCH_CHECK_VALUE(t.device() == masters[i].device() && t.sizes() == masters[i].sizes(), op, ": ", name, "[",
                        i, "] must match master_params[", i, "] in shape ", masters[i].sizes(), " and device ",
                        masters[i].device());
    }
  }
}

}  // namespace gpuops::optim::detail
