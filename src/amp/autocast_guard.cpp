// AutocastGuard: the enter/exit sequence of torch.autocast, in C++, correct in any destruction order.
//
// Each thread keeps its live guards in creation order. A guard that ends while newer ones live does not touch
// the current state (the newer guards are in force); it hands what it would have restored to the guards that
// would otherwise restore its setting: the next newer guard of its device type (device state) and the next
// newer guard (the cache flag, which is global). With no newer guard of its device, its device state is
// restored now. So however guards end, the state after the last one is the state before the first.
#include "gpuops/autocast.h"

#include <algorithm>
#include <vector>

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>

namespace gpuops::amp {
namespace {

thread_local std::vector<AutocastGuard*> live_guards;

}  // namespace

AutocastGuard::AutocastGuard(c10::DeviceType device_type, c10::ScalarType dtype, bool enabled, bool cache_enabled)
    : device_type_(device_type) {
  TORCH_CHECK_VALUE(at::autocast::is_autocast_available(device_type), "AutocastGuard: device_type ",
                    c10::DeviceTypeName(device_type), " has no autocast; accepted: cpu, cuda");
  TORCH_CHECK_VALUE(dtype == c10::kHalf || dtype == c10::kBFloat16, "AutocastGuard: dtype must be float16 or ",
                    "bfloat16, got ", dtype);
  previous_enabled_ = at::autocast::is_autocast_enabled(device_type);
  previous_dtype_ = at::autocast::get_autocast_dtype(device_type);
  previous_cache_enabled_ = at::autocast::is_autocast_cache_enabled();
  live_guards.push_back(this);
  at::autocast::set_autocast_enabled(device_type, enabled);
  at::autocast::set_autocast_dtype(device_type, dtype);
  at::autocast::increment_nesting();
  at::autocast::set_autocast_cache_enabled(cache_enabled);
}

AutocastGuard::~AutocastGuard() {
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  const auto self = std::find(live_guards.begin(), live_guards.end(), this);
  if (self == live_guards.end()) {  // ended on another thread than it began: restore as a scope would
    at::autocast::set_autocast_enabled(device_type_, previous_enabled_);
    at::autocast::set_autocast_dtype(device_type_, previous_dtype_);
    at::autocast::set_autocast_cache_enabled(previous_cache_enabled_);
    return;
  }
  const auto newer = std::next(self);
  const auto same_device = std::find_if(newer, live_guards.end(),
                                        [this](const AutocastGuard* g) { return g->device_type_ == device_type_; });
  if (same_device != live_guards.end()) {
    (*same_device)->previous_enabled_ = previous_enabled_;
    (*same_device)->previous_dtype_ = previous_dtype_;
  } else {
    at::autocast::set_autocast_enabled(device_type_, previous_enabled_);
    at::autocast::set_autocast_dtype(device_type_, previous_dtype_);
  }
  if (newer != live_guards.end()) {
    (*newer)->previous_cache_enabled_ = previous_cache_enabled_;
  } else {
    at::autocast::set_autocast_cache_enabled(previous_cache_enabled_);
  }
  live_guards.erase(self);
}

}  // namespace gpuops::amp
