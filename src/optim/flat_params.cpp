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

// Accepted ranges: past them the padding alone would be gigabytes (alignment_bytes * world_size per buffer).
constexpr int64_t kMaxAlignmentBytes = 4096;
constexpr int64_t kMaxWorldSize = int64_t{1} << 20;

void FlatParams::check(const std::vector<at::Tensor>& params, const FlatParamsOptions& options) {
  TORCH_CHECK_VALUE(!params.empty(), "FlatParams: params must not be empty");
  TORCH_CHECK_VALUE(options.alignment_bytes >= 1 && options.alignment_bytes <= kMaxAlignmentBytes &&
                        (options.alignment_bytes & (options.alignment_bytes - 1)) == 0,
                    "FlatParams: alignment_bytes must be a power of two in [1, ", kMaxAlignmentBytes, "], got ",
                    options.alignment_bytes);
  TORCH_CHECK_VALUE(options.world_size >= 1 && options.world_size <= kMaxWorldSize,
                    "FlatParams: world_size must be in [1, ", kMaxWorldSize, "], got ", options.world_size);
  std::set<const void*> seen;
  // Byte ranges per storage: two parameters over the same bytes (one a view of the other) would be copied
  // apart; disjoint slices of one storage (an earlier flat buffer) are fine.
  std::map<const void*, std::map<int64_t, std::pair<int64_t, size_t>>> ranges;  // storage -> begin -> (end, i)
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK_VALUE(p.defined() && p.is_leaf() && p.requires_grad(), "FlatParams: params[", i,
                      "] must be a leaf tensor that requires grad");
    TORCH_CHECK_VALUE(!p.is_sparse() && p.is_contiguous(), "FlatParams: params[", i, "] must be dense and contiguous");
    TORCH_CHECK_VALUE(seen.insert(p.unsafeGetTensorImpl()).second, "FlatParams: params[", i, "] is given twice");
    if (p.numel() > 0) {
      const int64_t begin = p.storage_offset() * static_cast<int64_t>(p.element_size());
      const int64_t end = begin + static_cast<int64_t>(p.nbytes());
      auto& taken = ranges[p.storage().unsafeGetStorageImpl()];
      auto next = taken.lower_bound(begin);
      const bool overlaps = (next != taken.end() && next->first < end) ||
                            (next != taken.begin() && std::prev(next)->second.first > begin);
      const size_t other = next != taken.end() && next->first < end ? next->second.second
                                                                      : overlaps ? std::prev(next)->second.second : i;
      TORCH_CHECK_VALUE(!overlaps, "FlatParams: params[", i, "] shares its memory with params[", other,
                        "] (a view of another parameter, or one weight given as two tensors); give each parameter "
                        "once, as its own tensor");
      taken.emplace(begin, std::make_pair(end, i));
    }
    TORCH_CHECK_VALUE(options.alignment_bytes >= static_cast<int64_t>(p.element_size()), "FlatParams: alignment_bytes (",
                      options.alignment_bytes, ") must be at least the element size of params[", i, "] (",
                      p.element_size(), ")");
    if (const at::Tensor& g = p.grad(); g.defined()) {
      TORCH_CHECK_VALUE(g.layout() == at::kStrided && g.sizes() == p.sizes() && g.scalar_type() == p.scalar_type() &&
                            g.device() == p.device(),
                        "FlatParams: params[", i, "].grad must be a dense tensor of the parameter's shape ", p.sizes(),
                        ", dtype ", p.scalar_type(), " and device ", p.device(), ", got ",
                        g.layout() == at::kStrided ? "" : "a sparse tensor of ", "shape ", g.sizes(), ", dtype ",
                        g.scalar_type(), " on ", g.device());
    }
  }
}

FlatParams::FlatParams(const std::vector<at::Tensor>& params, FlatParamsOptions options) {
  // Every check first, then every allocation and copy, and only then are the parameters changed: a failed
  // construction leaves them as they were.
  check(params, options);
  std::map<std::pair<std::string, at::ScalarType>, size_t> bucket_of;
  std::vector<Bucket> buckets;
  for (const at::Tensor& p : params) {
    const auto key = std::make_pair(p.device().str(), p.scalar_type());
    if (!bucket_of.count(key)) {
      bucket_of[key] = buckets.size();
      buckets.push_back({p.device(), p.scalar_type(), {}, {}, {}});
    }
    buckets[bucket_of[key]].slots.push_back({p, 0, p.numel()});
  }
  for (auto& bucket : buckets) {  // allocate and fill every buffer; no parameter changes yet
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
      alias(bucket.data, slot.offset, slot.param).copy_(slot.param);
      if (slot.param.grad().defined()) alias(bucket.grad, slot.offset, slot.param).copy_(slot.param.grad());
    }
  }
  c10::NoGradGuard no_grad;
  for (auto& bucket : buckets) {  // the swap: views made and installed, nothing here allocates a buffer
    for (auto& slot : bucket.slots) {
      slot.param.set_data(alias(bucket.data, slot.offset, slot.param));
      slot.param.mutable_grad() = alias(bucket.grad, slot.offset, slot.param);
    }
  }
  buckets_ = std::move(buckets);
}

std::vector<at::Tensor> FlatParams::flat_parameters() const {
  std::vector<at::Tensor> flat;
  for (const auto& bucket : buckets_) {
    TORCH_CHECK(bucket.grad.defined(), "FlatParams.flat_parameters: the gradients were released (release_grads); "
                "call zero_grad() first");
    at::Tensor whole = alias(bucket.data, 0, bucket.data).requires_grad_(true);
    whole.mutable_grad() = alias(bucket.grad, 0, bucket.grad);
    flat.push_back(whole);
  }
  return flat;
}

void FlatParams::zero_grad() {
  for (auto& bucket : buckets_) {
    if (bucket.grad.defined()) {
      bucket.grad.zero_();
    } else {
      bucket.grad = at::zeros_like(bucket.data);
    }
    for (auto& slot : bucket.slots) slot.param.mutable_grad() = alias(bucket.grad, slot.offset, slot.param);
  }
}

void FlatParams::release_grads() {
  for (auto& bucket : buckets_) {
    for (auto& slot : bucket.slots) slot.param.mutable_grad().reset();
    bucket.grad.reset();
  }
}

void FlatParams::adopt_grad(size_t b, size_t slot) {
  TORCH_CHECK_VALUE(b < buckets_.size() && slot < buckets_[b].slots.size(), "FlatParams::adopt_grad: bucket ", b,
                    " slot ", slot, " is out of range");
  Bucket& bucket = buckets_[b];
  const Slot& s = bucket.slots[slot];
  const at::Tensor own = s.param.grad();
  if (bucket.grad.defined() && own.defined() && own.storage().is_alias_of(bucket.grad.storage()) &&
      own.storage_offset() == bucket.grad.storage_offset() + s.offset)
    return;  // already its view
  c10::NoGradGuard no_grad;
  if (!bucket.grad.defined()) {
    bucket.grad = at::zeros_like(bucket.data);
    for (auto& other : bucket.slots) other.param.mutable_grad() = alias(bucket.grad, other.offset, other.param);
  } else {
    s.param.mutable_grad() = alias(bucket.grad, s.offset, s.param);
  }
  if (own.defined()) s.param.mutable_grad().copy_(own);
}

void FlatParams::rebind_data(size_t b, const at::Tensor& data) {
  TORCH_CHECK_VALUE(b < buckets_.size(), "FlatParams::rebind_data: bucket ", b, " is out of range");
  Bucket& bucket = buckets_[b];
  TORCH_CHECK_VALUE(data.defined() && data.dim() == 1 && data.numel() == bucket.data.numel() &&
                        data.scalar_type() == bucket.dtype && data.is_contiguous(),
                    "FlatParams::rebind_data: data must be a contiguous 1-D ", bucket.dtype, " tensor of ",
                    bucket.data.numel(), " elements");
  bucket.data = data;
  bucket.device = data.device();
  bucket.grad.reset();
  for (auto& slot : bucket.slots) slot.param.mutable_grad().reset();
}

void FlatParams::allocate_grad(size_t b) {
  TORCH_CHECK_VALUE(b < buckets_.size(), "FlatParams::allocate_grad: bucket ", b, " is out of range");
  if (!buckets_[b].grad.defined()) buckets_[b].grad = at::zeros_like(buckets_[b].data);
}

namespace {
// The parameter of slot `s` is no longer a view of its place in `b`'s buffer.
bool detached(const FlatParams::Bucket& b, const FlatParams::Slot& s) {
  return !s.param.storage().is_alias_of(b.data.storage()) || s.param.storage_offset() != b.data.storage_offset() + s.offset;
}
}  // namespace

bool FlatParams::attached() const {
  for (const auto& bucket : buckets_)
    for (const auto& s : bucket.slots)
      if (detached(bucket, s)) return false;
  return true;
}

int64_t FlatParams::reattach() {
  for (const auto& bucket : buckets_) {  // check all first
    for (size_t i = 0; i < bucket.slots.size(); ++i) {
      const Slot& s = bucket.slots[i];
      if (!detached(bucket, s)) continue;
      TORCH_CHECK_VALUE(s.param.numel() == s.numel && s.param.scalar_type() == bucket.dtype &&
                            s.param.device() == bucket.device,
                        "FlatParams: a parameter of ", s.numel, " elements (", bucket.dtype, " on ", bucket.device,
                        ") was replaced by a tensor of ", s.param.numel(), " (", s.param.scalar_type(), " on ",
                        s.param.device(), "); a flat buffer's parameters keep their shape, dtype and device");
    }
  }
  int64_t count = 0;
  c10::NoGradGuard no_grad;
  for (auto& bucket : buckets_) {
    for (auto& s : bucket.slots) {
      if (!detached(bucket, s)) continue;
      at::Tensor view = alias(bucket.data, s.offset, s.param);
      view.copy_(s.param.reshape(view.sizes()));
      s.param.set_data(view);
      ++count;
    }
  }
  return count;
}

bool FlatParams::intact() const {
  // Storage and offset, not data_ptr: a parameter with no elements has a null data_ptr yet is a view.
  const auto views = [](const at::Tensor& t, const at::Tensor& flat, int64_t offset) {
    return t.defined() && t.storage().is_alias_of(flat.storage()) &&
           t.storage_offset() == flat.storage_offset() + offset;
  };
  for (const auto& bucket : buckets_) {
    for (const auto& slot : bucket.slots) {
      if (!bucket.grad.defined() || !views(slot.param, bucket.data, slot.offset) ||
        !views(slot.param.grad(), bucket.grad, slot.offset))
        return false;
    }
  }
  return true;
}

at::Tensor FlatParams::shard(const at::Tensor& flat, int64_t rank, int64_t world_size) {
  TORCH_CHECK_VALUE(flat.defined() && flat.dim() == 1, "FlatParams::shard: flat must be a one-dimensional buffer, got ",
                    flat.defined() ? "a tensor of shape " + c10::str(flat.sizes()) : std::string("an undefined tensor"));
  TORCH_CHECK_VALUE(world_size >= 1 && flat.numel() % world_size == 0, "FlatParams::shard: world_size must divide the "
                    "buffer (", flat.numel(), " elements), got ", world_size);
  TORCH_CHECK_VALUE(rank >= 0 && rank < world_size, "FlatParams::shard: rank must be in [0, ", world_size, "), got ",
                    rank);
  const int64_t size = flat.numel() / world_size;
  return flat.narrow(0, rank * size, size);
}

}  // namespace gpuops
