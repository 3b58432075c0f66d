// gpuops::optim::ZeroShards (zero_optimizer.h), the step side: flat buffers, shards and masters, the
// reduction of the gradients, the global flag and norm, the all-gather. No optimizer math here.
#include <deque>
#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "gpuops/zero_optimizer.h"

namespace gpuops::optim {
namespace {

// A leaf over flat[offset, offset + numel): an alias made with set_, as FlatParams' (not an autograd view).
at::Tensor alias(const at::Tensor& flat, int64_t offset, int64_t numel) {
  c10::NoGradGuard no_grad;
  return at::empty({0}, flat.options()).set_(flat.storage(), flat.storage_offset() + offset, {numel}, {1});
}

// FNV-1a over what must agree across ranks: the count, and each parameter's dtype, device type and shape.
int64_t params_hash(const std::vector<at::Tensor>& params) {
  uint64_t h = 1469598103934665603ull;
  const auto mix = [&h](int64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= static_cast<uint64_t>(v >> (8 * i)) & 0xffu;
      h *= 1099511628211ull;
    }
  };
  mix(static_cast<int64_t>(params.size()));
  for (const at::Tensor& p : params) {
    if (!p.defined()) {
      mix(-1);
      continue;
    }
    mix(static_cast<int64_t>(p.scalar_type()));
    mix(static_cast<int64_t>(p.device().type()));
    mix(p.dim());
    for (int64_t s : p.sizes()) mix(s);
  }
  return static_cast<int64_t>(h & 0x7fffffffffffffffull);
}

// Local checks first (the same on every rank given the same arguments), then the one collective. Returns
// the parameters unchanged, so that the constructor can check before FlatParams changes anything.
const std::vector<at::Tensor>& checked(const std::vector<at::Tensor>& params, dist::Communicator& comm, int stage) {
  TORCH_CHECK_VALUE(stage == 1 || stage == 2, "ZeroOptimizer: stage must be 1 (optimizer state sharded) or 2 "
                    "(optimizer state and gradients sharded), got ", stage);
  for (size_t i = 0; i < params.size(); ++i) {
    const auto dtype = params[i].defined() ? params[i].scalar_type() : at::kFloat;
    TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, "ZeroOptimizer: params[",
                      i, "] is ", dtype, "; accepted: float32, or float16/bfloat16 (stepped on fp32 master shards)");
  }
  const int n = comm.size();
  // Every rank's [count, hash]: ranks that disagree all raise the same error, nothing changed.
  at::Tensor mine = at::tensor({static_cast<int64_t>(params.size()), params_hash(params)}, at::kLong);
  at::Tensor all = at::empty({2 * n}, at::kLong);
  comm.all_gather(mine, all).wait();
  const auto* v = all.data_ptr<int64_t>();
  for (int r = 1; r < n; ++r) {
    TORCH_CHECK_VALUE(v[2 * r] == v[0] && v[2 * r + 1] == v[1], "ZeroOptimizer: params differ across ranks: rank 0 "
                      "passed ", v[0], " parameters (shape hash ", v[1], "), rank ", r, " passed ", v[2 * r],
                      " (shape hash ", v[2 * r + 1], "); every rank must pass the same parameters (count, shapes, "
                      "dtypes), in the same order");
  }
  return params;
}

FlatParamsOptions padded_to(int world_size) {
  FlatParamsOptions o;
  o.world_size = world_size;
  return o;
}

}  // namespace

ZeroShards::ZeroShards(const std::vector<at::Tensor>& params, dist::Communicator communicator, int stage)
    : comm_(std::move(communicator)), stage_(stage) {
  flat_ = std::make_unique<FlatParams>(checked(params, comm_, stage), padded_to(comm_.size()));
  // params[i] -> (buffer, slot): FlatParams fills buffers in order of first appearance, slots in order.
  std::vector<size_t> next_slot(flat_->buckets().size(), 0);
  for (const at::Tensor& p : params) {
    for (size_t k = 0; k < flat_->buckets().size(); ++k) {
      const auto& b = flat_->buckets()[k];
      if (next_slot[k] < b.slots.size() && b.slots[next_slot[k]].param.unsafeGetTensorImpl() == p.unsafeGetTensorImpl()) {
        slot_of_param_.emplace_back(k, next_slot[k]++);
        break;
      }
    }
  }
  TORCH_INTERNAL_ASSERT(slot_of_param_.size() == params.size());
  c10::NoGradGuard no_grad;
  for (size_t k = 0; k < flat_->buckets().size(); ++k) {
    const at::Tensor shard = data_shard(k);
    // A float32 buffer's shard is stepped in place; a 16-bit one through its fp32 master.
    shards_.push_back(is_master(k) ? shard.to(at::kFloat).requires_grad_(true)
                                   : alias(flat_->buckets()[k].data, comm_.rank() * shard.numel(), shard.numel())
                                         .requires_grad_(true));
    shard_grads_.push_back(stage_ == 2 || is_master(k) ? at::zeros_like(shards_.back()) : at::Tensor());
  }
  versions_.resize(flat_->buckets().size());
  install_shard_grads();
  record_versions();
}

bool ZeroShards::is_master(size_t k) const { return flat_->buckets()[k].dtype != at::kFloat; }

at::Tensor ZeroShards::data_shard(size_t k) const { return comm_.shard(flat_->buckets()[k].data); }

void ZeroShards::install_shard_grads() {
  for (size_t k = 0; k < shards_.size(); ++k) {
    const int64_t s = shards_[k].numel();
    shards_[k].mutable_grad() =
        shard_grads_[k].defined() ? shard_grads_[k] : alias(flat_->buckets()[k].grad, comm_.rank() * s, s);
  }
}

void ZeroShards::record_versions() {
  for (size_t k = 0; k < shards_.size(); ++k) {
    versions_[k].clear();
    if (!is_master(k)) continue;
    for (const auto& slot : flat_->buckets()[k].slots) versions_[k].push_back(slot.param._version());
  }
}

void ZeroShards::zero_grad() {
  // A model loaded through torch's C++ Module::load points its parameters at the loaded tensors: copy them in.
  if (flat_->reattach() > 0) reattached_ = true;
  flat_->zero_grad();  // stage 2: allocates the flat gradients again
  install_shard_grads();
  reduced_ = false;
  stepped_ = false;
}

void ZeroShards::reduce_in_fp32(size_t k) {
  const at::Tensor& grad = flat_->buckets()[k].grad;
  const int n = comm_.size();
  const int64_t s = shard_grads_[k].numel();
  const at::Tensor rows = grad.view({n, s});  // row r: rank r's shard
  // Chunk c of every rank's shard, in fp32: the reduce-scatter leaves the sum of this rank's chunk. At most
  // two in flight, so the fp32 copies stay bounded whatever the buffer's size.
  std::deque<std::pair<dist::Work, at::Tensor>> in_flight;
  for (int64_t begin = 0; begin < s; begin += kReduceChunk) {
    const int64_t len = std::min(kReduceChunk, s - begin);
    at::Tensor input = rows.narrow(1, begin, len).to(at::kFloat).contiguous().view({-1});
    in_flight.emplace_back(comm_.reduce_scatter(input, shard_grads_[k].narrow(0, begin, len), dist::ReduceOp::Average),
                           input);
    if (in_flight.size() > 2) {
      in_flight.front().first.wait();
      in_flight.pop_front();
    }
  }
  for (auto& [work, input] : in_flight) work.wait();
}

void ZeroShards::reduce_gradients() {
  if (reduced_) return;
  TORCH_CHECK(!stepped_, "ZeroOptimizer: the gradients were spent by the last step; call zero_grad() (of this "
              "optimizer) before the next backward");
  bool ours = true;
  for (const at::Tensor& shard : shards_) ours = ours && shard.grad().defined();
  TORCH_CHECK(ours && flat_->intact(), "ZeroOptimizer: the parameters' gradients are no longer the flat buffer's "
              "views (something set them to None, e.g. torch::optim::Optimizer::zero_grad, which is not virtual); "
              "call ZeroOptimizer::zero_grad() before backward");
  c10::NoGradGuard no_grad;
  // Fixed order: the float32 buffers launched in turn and waited in turn, then the 16-bit ones chunk by chunk.
  std::vector<dist::Work> works;
  for (size_t k = 0; k < shards_.size(); ++k) {
    if (is_master(k)) continue;
    const at::Tensor& grad = flat_->buckets()[k].grad;
    works.push_back(shard_grads_[k].defined() ? comm_.reduce_scatter(grad, shard_grads_[k], dist::ReduceOp::Average)
                                              : comm_.reduce_scatter(grad, dist::ReduceOp::Average));
  }
  for (auto& w : works) w.wait();
  for (size_t k = 0; k < shards_.size(); ++k)
    if (is_master(k)) reduce_in_fp32(k);
  if (stage_ == 2) flat_->release_grads();  // only the shards are kept
  reduced_ = true;
}

at::Tensor ZeroShards::global_found_inf(const at::Tensor& found_inf) {
  at::Tensor flag = found_inf.detach().to(at::kFloat).contiguous().clone();
  comm_.all_reduce(flag, dist::ReduceOp::Max).wait();
  return flag.reshape(found_inf.sizes());
}

at::Tensor ZeroShards::global_grad_norm(const at::Tensor& norm) {
  at::Tensor squares = norm.detach().to(at::kDouble).square().reshape({1}).contiguous();
  comm_.all_reduce(squares, dist::ReduceOp::Sum).wait();
  return squares.sqrt().to(norm.scalar_type()).reshape(norm.sizes());
}

void ZeroShards::before_step() {
  c10::NoGradGuard no_grad;
  for (size_t k = 0; k < shards_.size(); ++k) {
    if (!is_master(k)) continue;
    const auto& slots = flat_->buckets()[k].slots;
    bool written = reattached_;
    for (size_t i = 0; i < slots.size(); ++i) written = written || slots[i].param._version() != versions_[k][i];
    if (!written) continue;
    // Element-wise: a master keeps its extra precision where it still rounds to the parameter.
    const at::Tensor data = data_shard(k);
    at::Tensor& master = shards_[k];
    master.copy_(at::where(master.to(data.scalar_type()).eq(data), master, data.to(at::kFloat)));
  }
  reattached_ = false;
}

void ZeroShards::after_step() {
  c10::NoGradGuard no_grad;
  for (size_t k = 0; k < shards_.size(); ++k)
    if (is_master(k)) data_shard(k).copy_(shards_[k]);  // round to nearest even
  std::vector<dist::Work> works;
  for (const auto& bucket : flat_->buckets()) works.push_back(comm_.all_gather(bucket.data));
  for (auto& w : works) w.wait();
  record_versions();
  reduced_ = false;
  stepped_ = true;
}

int64_t ZeroShards::gradient_bytes() const {
  int64_t bytes = 0;
  for (const auto& bucket : flat_->buckets())
    if (bucket.grad.defined()) bytes += static_cast<int64_t>(bucket.grad.nbytes());
  for (const at::Tensor& g : shard_grads_)
    if (g.defined()) bytes += static_cast<int64_t>(g.nbytes());
  return bytes;
}

int64_t ZeroShards::master_bytes() const {
  int64_t bytes = 0;
  for (size_t k = 0; k < shards_.size(); ++k)
    if (is_master(k)) bytes += static_cast<int64_t>(shards_[k].nbytes());
  return bytes;
}

}  // namespace gpuops::optim
