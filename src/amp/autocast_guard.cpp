// AutocastGuard: the enter/exit sequence of torch.autocast, in C++.
#include "gpuops/autocast.h"

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>

namespace gpuops::amp {

AutocastGuard::AutocastGuard(c10::DeviceType device_type, c10::ScalarType dtype, bool enabled, bool cache_enabled)
    : device_type_(device_type) {
  TORCH_CHECK_VALUE(at::autocast::is_autocast_available(device_type), "AutocastGuard: device_type ",
                    c10::DeviceTypeName(device_type), " has no autocast; accepted: cpu, cuda");
  TORCH_CHECK_VALUE(dtype == c10::kHalf || dtype == c10::kBFloat16, "AutocastGuard: dtype must be float16 or ",
                    "bfloat16, got ", dtype);
  previous_enabled_ = at::autocast::is_autocast_enabled(device_type);
  previous_dtype_ = at::autocast::get_autocast_dtype(device_type);
  previous_cache_enabled_ = at::autocast::is_autocast_cache_enabled();
  at::autocast::set_autocast_enabled(device_type, enabled);
  at::autocast::set_autocast_dtype(device_type, dtype);
  at::autocast::increment_nesting();
  at::autocast::set_autocast_cache_enabled(cache_enabled);
}

AutocastGuard::~AutocastGuard() {
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_type_, previous_enabled_);
  at::autocast::set_autocast_dtype(device_type_, previous_dtype_);
  at::autocast::set_autocast_cache_enabled(previous_cache_enabled_);
}

}  // namespace gpuops::amp
