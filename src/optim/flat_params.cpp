// FlatParams (flat_params.h): one contiguous buffer per (device, dtype), parameters and gradients as views.
#include "gpuops/flat_params.h"

#include <map>
#include <set>
#include <utility>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

namespace gpuops {
namespace {

int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// A tensor over flat[offset, offset + numel) shaped like `like`. An alias made with set_, not an autograd
// view: optimizers' zero_grad detaches gradients in place, which views refuse.
at::Tensor alias(const at::Tensor& flat, int64_t offset, const at::Tensor& like) {
  c10::NoGradGuard no_grad;
  return at::empty({0}, flat.options()).set_(flat.storage(), flat.storage_offset() + offset, like.sizes(),
                                            like.contiguous().strides());
}

}  // namespace

FlatParams::FlatParams(const std::vector<at::Tensor>& params, FlatParamsOptions options) {
  TORCH_CHECK_VALUE(!params.empty(), "FlatParams: params must not be empty");
  TORCH_CHECK_VALUE(options.alignment_bytes >= 1 && (options.alignment_bytes & (options.alignment_bytes - 1)) == 0,
                    "FlatParams: alignment_bytes must be a power of two, got ", options.alignment_bytes);
  TORCH_CHECK_VALUE(options.world_size >= 1, "FlatParams: world_size must be >= 1, got ", options.world_size);
  // Every check first: a failed construction leaves the parameters as they were.
  std::set<const void*> seen;
  std::map<std::pair<std::string, at::ScalarType>, size_t> bucket_of;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK_VALUE(p.defined() && p.is_leaf() && p.requires_grad(), "FlatParams: params[", i,
                      "] must be a leaf tensor that requires grad");
    TORCH_CHECK_VALUE(!p.is_sparse() && p.is_contiguous(), "FlatParams: params[", i, "] must be dense and contiguous");
    TORCH_CHECK_VALUE(seen.insert(p.unsafeGetTensorImpl()).second, "FlatParams: params[", i, "] is given twice");
    TORCH_CHECK_VALUE(options.alignment_bytes >= static_cast<int64_t>(p.element_size()), "FlatParams: alignment_bytes (",
                      options.alignment_bytes, ") must be at least the element size of params[", i, "] (",
                      p.element_size(), ")");
    const auto key = std::make_pair(p.device().str(), p.scalar_type());
    if (!bucket_of.count(key)) {
      bucket_of[key] = buckets_.size();
      buckets_.push_back({p.device(), p.scalar_type(), {}, {}, {}});
    }
    buckets_[bucket_of[key]].slots.push_back({p, 0, p.numel()});
  }
  for (auto& bucket : buckets_) {
    const int64_t align = options.alignment_bytes / static_cast<int64_t>(c10::elementSize(bucket.dtype));
    int64_t offset = 0;
    for (auto& slot : bucket.slots) {
      slot.offset = offset;
      offset = round_up(offset + slot.numel, align);
    }
    const int64_t total = round_up(std::max<int64_t>(offset, 1), align * options.world_size);
    const auto tensor_options = at::TensorOptions(bucket.dtype).device(bucket.device);
    bucket.data = at::zeros({total}, tensor_options);
    bucket.grad = at::zeros({total}, tensor_options);
    c10::NoGradGuard no_grad;
    for (auto& slot : bucket.slots) {
      auto data_view = alias(bucket.data, slot.offset, slot.param);
      data_view.copy_(slot.param);
      slot.param.set_data(data_view);
      auto grad_view = alias(bucket.grad, slot.offset, slot.param);
      if (slot.param.grad().defined()) grad_view.copy_(slot.param.grad());
      slot.param.mutable_grad() = grad_view;
    }
  }
}

std::vector<at::Tensor> FlatParams::flat_parameters() const {
  std::vector<at::Tensor> flat;
  for (const auto& bucket : buckets_) {
    at::Tensor whole = alias(bucket.data, 0, bucket.data).requires_grad_(true);
    whole.mutable_grad() = alias(bucket.grad, 0, bucket.grad);
    flat.push_back(whole);
  }
  return flat;
}

void FlatParams::zero_grad() {
  for (auto& bucket : buckets_) {
    bucket.grad.zero_();
    for (auto& slot : bucket.slots) slot.param.mutable_grad() = alias(bucket.grad, slot.offset, slot.param);
  }
}

bool FlatParams::intact() const {
  for (const auto& bucket : buckets_) {
    const auto data_base = static_cast<const char*>(bucket.data.data_ptr());
    const auto grad_base = static_cast<const char*>(bucket.grad.data_ptr());
    const auto size = static_cast<int64_t>(c10::elementSize(bucket.dtype));
    for (const auto& slot : bucket.slots) {
      const at::Tensor& grad = slot.param.grad();
      if (slot.param.data_ptr() != data_base + slot.offset * size) return false;
      if (!grad.defined() || grad.data_ptr() != grad_base + slot.offset * size) return false;
    }
  }
  return true;
}

at::Tensor FlatParams::shard(const at::Tensor& flat, int64_t rank, int64_t world_size) {
  TORCH_CHECK_VALUE(world_size >= 1 && flat.numel() % world_size == 0, "FlatParams::shard: world_size must divide the "
                    "buffer (", flat.numel(), " elements), got ", world_size);
  TORCH_CHECK_VALUE(rank >= 0 && rank < world_size, "FlatParams::shard: rank must be in [0, ", world_size, "), got ",
                    rank);
  const int64_t size = flat.numel() / world_size;
  return flat.narrow(0, rank * size, size);
}

}  // namespace gpuops
