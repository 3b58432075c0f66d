// gpuops::ActivationOffloader (activation_offload.h). Beside a GPU every copy runs on one side stream: a copy to
// the host waits for the work that made the tensor (an event of the current stream) and the allocator is told
// that the side stream reads the tensor, so autograd may free it at once; a copy back waits for the copy to the
// host, and the stream that reads the result waits for the copy back. On the CPU the copies are synchronous
// and the host copies are made outside any MemoryBudget (which then stands for the device, as in the tests).
#include "gpuops/activation_offload.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include "gpuops/memory_budget.h"

namespace gpuops {
namespace {

c10::Stream current_stream(c10::Device device) {
  return c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
}

// The allocator must not hand `t`'s memory to other work before `stream` has read or written it.
void used_on(const at::Tensor& t, c10::Stream stream) {
  c10::impl::getDeviceGuardImpl(stream.device_type())->recordDataPtrOnStream(t.storage().data_ptr(), stream);
}

}  // namespace

ActivationOffloader::ActivationOffloader(ActivationOffloadOptions options) : options_(options) {
  TORCH_CHECK_VALUE(options.min_bytes >= 0, "ActivationOffloader: min_bytes must be >= 0, got ", options.min_bytes);
  TORCH_CHECK_VALUE(options.prefetch >= 0 && options.prefetch <= 64, "ActivationOffloader: prefetch must be in [0, "
                    "64] layers, got ", options.prefetch);
  began_ = std::chrono::steady_clock::now();
}

ActivationOffloader::~ActivationOffloader() { clear(); }

double ActivationOffloader::now_s() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - began_).count();
}

void ActivationOffloader::enter_layer(int64_t layer) {
  TORCH_CHECK_VALUE(layer >= 0, "ActivationOffloader.enter_layer: layer must be >= 0, got ", layer);
  layer_ = layer;
}

void ActivationOffloader::leave_layer() { layer_.reset(); }

int64_t ActivationOffloader::pack(const at::Tensor& t) {
  if (!layer_ || !t.defined() || t.is_sparse() || !(t.is_cpu() || t.is_cuda())) return -1;
  if (static_cast<int64_t>(t.nbytes()) < options_.min_bytes) return -1;
  if (t.is_cuda() && side_ && side_->device() != t.device()) return -1;  // one device per store: its side stream
  const auto same = handle_of_.find(t.unsafeGetTensorImpl());
  if (same != handle_of_.end()) {  // saved again (the entry's weak reference keeps the address from reuse)
    Entry& e = entries_.at(same->second);
    if (e.original.lock().get() == t.unsafeGetTensorImpl() && e.saved_version == t._version()) {
      ++e.uses;
      return same->second;
    }
  }
  if (entries_.empty()) {  // nothing held: a new forward (the last backward released everything)
    timeline_.clear();
    began_ = std::chrono::steady_clock::now();
    last_unpacked_layer_ = -1;
  }
  const double begin = now_s();
  Entry e;
  e.where = t.device();
  e.layer = *layer_;
  e.uses = 1;
  e.original = c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr());
  e.version = t.unsafeGetTensorImpl()->version_counter();
  e.saved_version = e.version.current_version();
  {
    UnbudgetedScope host;  // host memory: not the device's
    // Its layout kept where it is dense (channels-last, a transpose); overlapping or gapped views made contiguous.
    const auto on_host = t.options().device(at::kCPU).pinned_memory(t.is_cuda()).requires_grad(false);
    e.host = t.is_non_overlapping_and_dense() ? at::empty_strided(t.sizes(), t.strides(), on_host)
                                              : at::empty(t.sizes(), on_host);
  }
  if (t.is_cuda()) {
    const c10::Stream current = current_stream(t.device());
    if (!side_) side_ = c10::impl::getDeviceGuardImpl(t.device().type())->getStreamFromGlobalPool(t.device());
    c10::Event made(t.device().type());
    made.record(current);
    made.block(*side_);  // the side stream copies what the current one has written
    {
      c10::StreamGuard on_side(*side_);
      e.host.copy_(t.detach(), /*non_blocking=*/true);
    }
    used_on(t, *side_);
    e.to_host.emplace(t.device().type());
    e.to_host->record(*side_);
  } else {
    e.host.copy_(t.detach());
  }
  const int64_t handle = next_handle_++;
  handle_of_[t.unsafeGetTensorImpl()] = handle;
  handles_of_layer_[e.layer].push_back(handle);
  timeline_.push_back({"to host", e.layer, static_cast<int64_t>(t.nbytes()), begin, now_s()});
  entries_.emplace(handle, std::move(e));
  return handle;
}

ActivationOffloader::Entry& ActivationOffloader::entry(int64_t handle, const char* what) {
  const auto found = entries_.find(handle);
  TORCH_CHECK_VALUE(found != entries_.end(), "ActivationOffloader.", what, ": handle ", handle, " is unknown or "
                    "released (a saved tensor unpacked after clear(), or after the graph was freed)");
  return found->second;
}

void ActivationOffloader::bring_back(int64_t layer, const char* what) {
  const auto handles = handles_of_layer_.find(layer);
  if (handles == handles_of_layer_.end()) return;
  for (const int64_t h : handles->second) {
    Entry& e = entries_.at(h);
    if (e.device.defined()) continue;
    const double begin = now_s();
    if (e.where.is_cuda()) {  // after its copy to the host: both on the side stream, in order
      c10::StreamGuard on_side(*side_);
      e.device = e.host.to(e.where, /*non_blocking=*/true);
      e.back.emplace(e.where.type());
      e.back->record(*side_);
    } else {
      e.device = e.host.clone();  // counted by a MemoryBudget: the device's bytes again
    }
    timeline_.push_back({what, e.layer, static_cast<int64_t>(e.host.nbytes()), begin, now_s()});
  }
}

at::Tensor ActivationOffloader::unpack(int64_t handle) {
  Entry& e = entry(handle, "unpack");
  // torch skips its own check when saved-tensor hooks hold a tensor; beside a GPU a change queued after the
  // save may even race the copy to the host: refused as torch refuses it.
  TORCH_CHECK(e.version.current_version() == e.saved_version, "one of the variables needed for gradient "
              "computation has been modified by an inplace operation: an activation kept in host memory "
              "(offload_activations) is at version ", e.version.current_version(), "; expected version ",
              e.saved_version, " instead");
  const int64_t layer = e.layer;
  if (!e.device.defined()) bring_back(layer, "back on demand");
  if (layer != last_unpacked_layer_) {  // this layer's backward begins: the next ones start coming back
    last_unpacked_layer_ = layer;
    for (int64_t ahead = 1; ahead <= options_.prefetch && layer - ahead >= 0; ++ahead)
      bring_back(layer - ahead, "prefetch");
  }
  Entry& ready = entries_.at(handle);
  if (ready.back) {  // the reader's stream waits for the copy back, and the allocator learns of the reader
    const c10::Stream reader = current_stream(ready.where);
    ready.back->block(reader);
    used_on(ready.device, reader);
  }
  return ready.device;
}

void ActivationOffloader::release(int64_t handle) {
  const auto found = entries_.find(handle);
  if (found == entries_.end() || --found->second.uses > 0) return;
  const auto same =
      std::find_if(handle_of_.begin(), handle_of_.end(), [&](const auto& kv) { return kv.second == handle; });
  if (same != handle_of_.end()) handle_of_.erase(same);
  auto& of_layer = handles_of_layer_[found->second.layer];
  of_layer.erase(std::remove(of_layer.begin(), of_layer.end(), handle), of_layer.end());
  if (of_layer.empty()) handles_of_layer_.erase(found->second.layer);
  if (found->second.to_host) found->second.to_host->synchronize();  // its pinned buffer may be reused at once
  entries_.erase(found);
}

void ActivationOffloader::clear() {
  for (auto& [handle, e] : entries_)
    if (e.to_host) e.to_host->synchronize();
  entries_.clear();
  handle_of_.clear();
  handles_of_layer_.clear();
  last_unpacked_layer_ = -1;
  timeline_.clear();
  began_ = std::chrono::steady_clock::now();
}

int64_t ActivationOffloader::host_bytes() const {
  int64_t bytes = 0;
  for (const auto& [handle, e] : entries_) bytes += static_cast<int64_t>(e.host.nbytes());
  return bytes;
}

int64_t ActivationOffloader::device_bytes() const {
  int64_t bytes = 0;
  for (const auto& [handle, e] : entries_)
    if (e.device.defined()) bytes += static_cast<int64_t>(e.device.nbytes());
  return bytes;
}

}  // namespace gpuops
