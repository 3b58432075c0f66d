#pragma once
// AutocastGuard: torch.autocast for LibTorch C++ (pytorch/pytorch issue 44710).
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace gpuops::amp {

/// RAII autocast region that behaves as `with torch.autocast(device_type, dtype, enabled, cache_enabled)`:
/// it sets the autocast state of `device_type`, counts nesting, restores the previous state on exit and
/// clears the cast cache when the outermost region ends. dtype: float16 or bfloat16. Guards may end in any
/// order (e.g. held in unique_ptrs): once every guard of a thread has ended, the state is the one before the first.
class AutocastGuard {
 public:
  explicit AutocastGuard(c10::DeviceType device_type, c10::ScalarType dtype = c10::kBFloat16, bool enabled = true,
                         bool cache_enabled = true);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  c10::DeviceType device_type_;
  bool previous_enabled_;
  c10::ScalarType previous_dtype_;
  bool previous_cache_enabled_;
};

}  // namespace gpuops::amp
