// The AMP ops as torch operators (torch.ops.gpuops.*): the Python GradScaler calls them, and they work
// under torch.compile and opcheck like any registered op.
#include <torch/library.h>

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

}  // namespace

TORCH_LIBRARY(gpuops, m) {
  m.def("unscaled_grad_norm_(Tensor[] grads, Tensor inv_scale, Tensor(a!) found_inf) -> Tensor",
        TORCH_FN(unscaled_grad_norm_op));
  m.def("unscale_and_check_(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor inv_scale) -> ()",
        TORCH_FN(unscale_and_check_op));
  m.def(
      "update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor(c!) hysteresis_left, Tensor found_inf, "
      "float growth_factor, float backoff_factor, int growth_interval, int hysteresis, float min_scale, "
      "float max_scale) -> ()",
      TORCH_FN(update_scale_op));
}
