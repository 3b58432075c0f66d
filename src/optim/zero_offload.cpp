// gpuops::optim::ZeroShards (zero_optimizer.h), offload (issue 33): the shard parameters and their gradients in
// host memory. Each bucket's reduced gradient shard goes to the host as soon as its reduction ends, at the step
// or (reduce_in_backward) during each backward (on a GPU asynchronously, into pinned memory, with an event per
// bucket; the micro-batches of an accumulation window summed on the host); ZeroOptimizer steps the buckets in
// turn on the host, each after its own copy has ended, and sends each one's values back as its step ends. The
// timeline records when each of these ran.
#include <algorithm>

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include "gpuops/memory_budget.h"
#include "gpuops/zero_optimizer.h"

namespace gpuops::optim {

at::Tensor ZeroShards::host_like(const at::Tensor& shard) const {
  UnbudgetedScope host;  // host memory: not the device's (a CPU MemoryBudget stands for the device)
  return at::empty(shard.sizes(), at::TensorOptions().dtype(at::kFloat).pinned_memory(shard.is_cuda()));
}

double ZeroShards::seconds_since_reduction() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - reduction_began_).count();
}

void ZeroShards::record(const std::string& what, size_t k, double begin_s) {
  timeline_.push_back({what, k, begin_s, seconds_since_reduction()});
}

void ZeroShards::begin_timeline() {
  if (!offloaded()) return;
  timeline_.clear();
  for (auto& copied : grad_copied_)  // a copy still running (a bucket not stepped) ends before its gradient is reused
    if (copied) copied->synchronize();
  grad_copied_.clear();  // (an event cannot be copied: no assign)
  grad_copied_.resize(shards_.size());
  reduction_began_ = std::chrono::steady_clock::now();
}

void ZeroShards::send_to_host(size_t k, const at::Tensor& reduced) {
  copy_begin_s_[k] = seconds_since_reduction();
  const bool gpu = reduced.is_cuda();
  shard_grads_[k].copy_(reduced, /*non_blocking=*/gpu);
  if (!gpu) {  // a CPU copy has ended here
    record("gradient to host", k, copy_begin_s_[k]);
    return;
  }
  // `reduced` may be freed as soon as the copy is queued: the caching allocator hands its memory only to work
  // queued after it on this stream. The event tells the host when the gradient has arrived.
  const c10::Device device = reduced.device();
  grad_copied_[k].emplace(device.type());
  grad_copied_[k]->record(c10::impl::getDeviceGuardImpl(device.type())->getStream(device));
}

void ZeroShards::receive_on_host(size_t k, const at::Tensor& reduced, bool accumulate) {
  if (!accumulate) return send_to_host(k, reduced);  // the window's first: straight into the host gradient
  wait_for_host_gradient(k);  // (the previous micro-batch's copy)
  const double begin = seconds_since_reduction();
  if (!host_scratch_.defined()) {  // one buffer for every bucket's later micro-batches, made once
    int64_t largest = 0;
    for (const at::Tensor& shard : shards_) largest = std::max<int64_t>(largest, shard.numel());
    host_scratch_ = host_like(reduced.narrow(0, 0, 1).expand({largest}));  // (a view: sizes and device only)
  }
  at::Tensor staged = host_scratch_.narrow(0, 0, reduced.numel()).copy_(reduced);  // synchronous: read next
  shard_grads_[k].add_(staged);  // the sum kept on the host, in fp32 as on the device
  record("gradient added on host", k, begin);
}

void ZeroShards::wait_for_host_gradient(size_t k) {
  if (!grad_copied_.empty() && grad_copied_[k]) {
    grad_copied_[k]->synchronize();  // the host reads this gradient next: it must have arrived
    grad_copied_[k].reset();
    record("gradient to host", k, copy_begin_s_[k]);
  }
}

void ZeroShards::send_shard(size_t k) {
  const double begin = seconds_since_reduction();
  c10::NoGradGuard no_grad;
  at::Tensor param = param_shard(k);  // (stage 3: the device's shard, what the units gather)
  at::Tensor values = shards_[k];
  if (is_master(k)) {  // rounded on the host (to nearest even), then copied: the device never holds fp32
    if (host_low_.size() != shards_.size()) host_low_.resize(shards_.size());
    if (!host_low_[k].defined()) {
      UnbudgetedScope host;
      host_low_[k] = at::empty(values.sizes(), at::TensorOptions().dtype(param.scalar_type())
                                                   .pinned_memory(param.is_cuda()));  // (an asynchronous copy)
    }
    values = host_low_[k].copy_(values);
  }
  param.copy_(values, /*non_blocking=*/param.is_cuda());  // queued before the all-gather on the same stream
  record("parameters to device", k, begin);
}

}  // namespace gpuops::optim
