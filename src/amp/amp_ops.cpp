// The AMP ops as torch operators (torch.ops.gpuops.*): the Python GradScaler calls them, and they work
// under torch.compile and opcheck like any registered op (common/op_registration.h).
#include <torch/library.h>

#include <ATen/ops/empty.h>

#include "../common/op_registration.h"
#include "amp_checks.h"
#include "gpuops/amp.h"

namespace {

void unscale_and_check_op(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  gpuops::amp::unscale_and_check_(grads, found_inf, inv_scale);
}

void update_scale_op(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& hysteresis_left,
                     const at::Tensor& found_inf, double growth_factor, double backoff_factor, int64_t growth_interval,
                     int64_t hysteresis, double min_scale, double max_scale) {
  gpuops::amp::update_scale_(scale, growth_tracker, hysteresis_left, found_inf,
                             {growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale});
}

at::Tensor unscaled_grad_norm_op(at::TensorList grads, const at::Tensor& inv_scale, const at::Tensor& found_inf) {
  return gpuops::amp::unscaled_grad_norm_(grads, inv_scale, found_inf);
}

// Fake-tensor kernels: the real kernels' metadata checks (no data is read), then the outputs' shapes.
// (any_view: unscale_and_check_ also takes strided views and float64, through torch's kernel.)
void check_grads_and_flag(const char* op, at::TensorList grads, const at::Tensor& found_inf,
                          const at::Tensor& inv_scale, bool any_view) {
  TORCH_CHECK_VALUE(found_inf.defined(), op, ": found_inf is undefined");
  gpuops::amp::detail::check_scalar_state(found_inf, "found_inf", at::kFloat, found_inf.device());
  gpuops::amp::detail::check_scalar_state(inv_scale, "inv_scale", at::kFloat, found_inf.device());
  gpuops::amp::detail::check_grads(op, grads, found_inf.device(), any_view);
}

void unscale_and_check_meta(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  check_grads_and_flag("unscale_and_check_", grads, found_inf, inv_scale, /*any_view=*/true);
}

at::Tensor unscaled_grad_norm_meta(at::TensorList grads, const at::Tensor& inv_scale, const at::Tensor& found_inf) {
  check_grads_and_flag("unscaled_grad_norm_", grads, found_inf, inv_scale, /*any_view=*/false);
  return at::empty({1}, found_inf.options());
}

void update_scale_meta(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& hysteresis_left,
                       const at::Tensor& found_inf, double, double, int64_t, int64_t, double, double) {
  using gpuops::amp::detail::check_scalar_state;
  TORCH_CHECK_VALUE(scale.defined(), "update_scale_: scale is undefined");
  check_scalar_state(scale, "scale", at::kFloat, scale.device());
  check_scalar_state(growth_tracker, "growth_tracker", at::kInt, scale.device());
  check_scalar_state(hysteresis_left, "hysteresis_left", at::kInt, scale.device());
  check_scalar_state(found_inf, "found_inf", at::kFloat, scale.device());
}

}  // namespace

TORCH_LIBRARY(gpuops, m) {
  using gpuops::ops::impl_mutating_op;
  m.def("unscaled_grad_norm_(Tensor[] grads, Tensor inv_scale, Tensor(a!) found_inf) -> Tensor");
  impl_mutating_op(m, "unscaled_grad_norm_", TORCH_FN(unscaled_grad_norm_op), TORCH_FN(unscaled_grad_norm_meta));
  m.def("unscale_and_check_(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor inv_scale) -> ()");
  impl_mutating_op(m, "unscale_and_check_", TORCH_FN(unscale_and_check_op), TORCH_FN(unscale_and_check_meta));
  m.def(
      "update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor(c!) hysteresis_left, Tensor found_inf, "
      "float growth_factor, float backoff_factor, int growth_interval, int hysteresis, float min_scale, "
      "float max_scale) -> ()");
  impl_mutating_op(m, "update_scale_", TORCH_FN(update_scale_op), TORCH_FN(update_scale_meta));
}
