// gpuops::optim::ZeroShards (zero_optimizer.h), stage 3: units of parameters that exist in full only while they
// run. Each unit's buckets keep their flat buffer tensor (sizes, layout) but its storage holds bytes only while
// the unit is gathered; the parameters meanwhile are empty placeholders, so that code reading one outside its
// unit fails on its shape instead of reading freed memory. Autograd's saved views of a parameter (a weight's
// transpose, say) point at the bucket's storage object itself, so gathering into that same storage before the
// unit's backward makes them valid again, and freeing it after the forward really frees the bytes.
#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>
#include <fmt/format.h>

#include "../memory/memory_scope.h"
#include "gpuops/agreement.h"
#include "gpuops/zero_optimizer.h"

namespace gpuops::optim {
namespace {

void free_storage(const at::Tensor& flat) {
  c10::StorageImpl* s = flat.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(at::DataPtr(nullptr, s->device()));
  s->set_nbytes(0);
}

void allocate_storage(const at::Tensor& flat) {
  c10::StorageImpl* s = flat.storage().unsafeGetStorageImpl();
  const size_t nbytes = flat.nbytes();  // a bucket's buffer starts its storage
  if (s->nbytes() >= nbytes && s->data_ptr().get() != nullptr) return;
  TORCH_INTERNAL_ASSERT(s->allocator() != nullptr, "ZeroOptimizer: a flat buffer's storage has no allocator");
  s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
  s->set_nbytes(nbytes);
}

// A contiguous tensor over flat's storage at `offset` elements, of like's shape: made with set_, so that it
// follows the storage through frees and gathers.
at::Tensor view_at(const at::Tensor& flat, int64_t offset, const at::Tensor& like) {
  c10::NoGradGuard no_grad;
  return at::empty({0}, flat.options()).set_(flat.storage(), flat.storage_offset() + offset, like.sizes(), {});
}

}  // namespace

bool ZeroShards::in_backward() const { return torch::autograd::get_current_graph_task_id() != -1; }

at::Tensor ZeroShards::param_shard(size_t k) const {
  if (options_.stage != 3) return data_shard(k);
  return separate_shard(k) ? low_shards_[k] : shards_[k].detach();
}

void ZeroShards::ensure_grad(size_t k) {
  if (bucket(k).grad.defined()) return;
  if (options_.stage != 3) {
    flats_[k]->zero_grad();
    return;
  }
  // FlatParams' zero_grad would give the placeholders views of full shape: a buffer alone (no gradient arrived).
  flats_[k]->allocate_grad(0);
}

at::Tensor ZeroShards::park(size_t k) {
  c10::NoGradGuard no_grad;
  at::Tensor shard = data_shard(k).clone();
  if (options_.device) {  // the unit's home from now on: its shard and a buffer (no bytes yet) on that device
    shard = shard.to(*options_.device);
    const at::Tensor host = bucket(k).data;
    flats_[k]->rebind_data(0, at::empty(host.sizes(), host.options().device(*options_.device)));
  }
  const auto& b = bucket(k);
  full_views_.emplace_back();
  for (const auto& slot : b.slots) full_views_.back().push_back(view_at(b.data, slot.offset, slot.param));
  flats_[k]->release_grads();
  const at::Tensor no_bytes = at::empty({1}, b.data.options());  // expanded: every parameter's shape, 4 bytes
  for (const auto& slot : b.slots) {
    at::Tensor param = slot.param;
    param.set_data(no_bytes.expand(full_views_[k].at(&slot - b.slots.data()).sizes()));
  }
  free_storage(b.data);
  return shard;
}

void ZeroShards::build_units() {
  const auto& units = options_.units;
  const size_t count = units.empty() ? 1 : static_cast<size_t>(*std::max_element(units.begin(), units.end()) + 1);
  unit_buckets_.assign(count, {});
  unit_of_bucket_.assign(flats_.size(), 0);
  for (size_t k = 0; k < flats_.size(); ++k) {
    const size_t first_param = param_of_slot_[k][0];
    const size_t u = units.empty() ? 0 : static_cast<size_t>(units[first_param]);
    unit_of_bucket_[k] = u;
    unit_buckets_[u].push_back(k);
  }
  unit_state_.assign(count, UnitState::Full);
  unit_works_.clear();
  unit_works_.resize(count);
  unit_ready_.assign(count, 0);
  release_units();
}

namespace {
const char* reason(int64_t why) {
  switch (static_cast<ZeroShards::GatherFor>(why)) {
    case ZeroShards::GatherFor::Forward: return "a forward";
    case ZeroShards::GatherFor::ForwardNoGrad: return "a forward without autograd";
    case ZeroShards::GatherFor::Backward: return "a backward";
    case ZeroShards::GatherFor::Read: return "a read of the full parameters";
  }
  return "?";
}
}  // namespace

void ZeroShards::agree_on_unit(size_t u, GatherFor why) {
  if (!options_.check_unit_order || comm_.size() == 1) return;
  memory::UnbudgetedEverywhere unbudgeted;  // its few bytes: a rank at its budget's limit still takes part
  const int n = comm_.size();
  const at::Tensor mine = at::tensor({static_cast<int64_t>(u), static_cast<int64_t>(why)}, at::kLong);
  at::Tensor all = at::empty({2 * n}, mine.options().device(comm_.control_device()));
  comm_.all_gather(mine.to(all.device()), all).wait();
  all = all.cpu();
  const int64_t* v = all.data_ptr<int64_t>();
  for (int r = 1; r < n; ++r) {
    if (v[2 * r] == v[0] && v[2 * r + 1] == v[1]) continue;
    TORCH_CHECK_VALUE(false, "ZeroOptimizer (stage 3): the ranks gather different units: rank 0 unit ", v[0],
                      " for ", reason(v[1]), ", rank ", r, " unit ", v[2 * r], " for ", reason(v[2 * r + 1]),
                      " (this is rank ", comm_.rank(), "). Every rank must run the same units in the same order, "
                      "each forward followed by its backward on every rank (a layer skipped or an extra forward on "
                      "some ranks, LayerDrop drawn with a seed per rank). Nothing was gathered; the ranks raised "
                      "together");
  }
}

void ZeroShards::gather_unit(size_t u, GatherFor why) {
  if (unit_state_[u] != UnitState::Sharded) return;
  agree_on_unit(u, why);
  c10::NoGradGuard no_grad;
  for (size_t k : unit_buckets_[u]) {
    allocate_storage(bucket(k).data);
    unit_works_[u].push_back(comm_.all_gather(param_shard(k), bucket(k).data));
  }
  unit_state_[u] = UnitState::Gathering;
}

void ZeroShards::wait_unit(size_t u, GatherFor why) {
  gather_unit(u, why);
  if (unit_state_[u] == UnitState::Full) return;
  for (auto& work : unit_works_[u]) work.wait();
  unit_works_[u].clear();
  c10::NoGradGuard no_grad;
  for (size_t k : unit_buckets_[u]) {  // something that replaced a placeholder (module.to(), .data =) is named
    const auto& b = bucket(k);
    for (size_t i = 0; i < b.slots.size(); ++i) {
      const at::Tensor& p = b.slots[i].param;
      TORCH_CHECK_VALUE(p.numel() == 0 && p.scalar_type() == b.dtype && p.device() == b.device, "ZeroOptimizer: ",
                        describe(k, i), " was replaced while sharded (now ", p.scalar_type(), " on ", p.device(),
                        " of shape ", p.sizes(), "): stage 3 holds the parameters; load values with "
                        "model.load_state_dict in Python or shards().load_full_parameters in C++ (every rank), and "
                        "change dtype or device before building the optimizer");
    }
  }
  for (size_t k : unit_buckets_[u]) {
    const auto& b = bucket(k);
    for (size_t i = 0; i < b.slots.size(); ++i) {
      at::Tensor param = b.slots[i].param;
      param.set_data(full_views_[k][i]);
      // A gradient buffer kept from an earlier micro-batch (local accumulation): backward adds into it.
      if (b.grad.defined()) param.mutable_grad() = view_at(b.grad, b.slots[i].offset, full_views_[k][i]);
    }
    rehook(k);  // the parameters have their shapes: a new accumulator made here expects the right gradient
  }
  unit_state_[u] = UnitState::Full;
}

void ZeroShards::release_unit(size_t u) {
  if (unit_state_[u] == UnitState::Sharded) return;
  if (unit_state_[u] == UnitState::Gathering) {  // every rank launched it: it completes before the bytes go
    for (auto& work : unit_works_[u]) work.wait();
    unit_works_[u].clear();
  }
  c10::NoGradGuard no_grad;
  for (size_t k : unit_buckets_[u]) {
    const auto& b = bucket(k);
    for (const auto& slot : b.slots) {
      at::Tensor param = slot.param;
      param.mutable_grad().reset();  // the flat gradient (if any) stays: reduced, or accumulated into again
      param.set_data(at::empty({0}, b.data.options()));
    }
    free_storage(b.data);
  }
  unit_state_[u] = UnitState::Sharded;
}

void ZeroShards::release_units() {
  for (size_t u = 0; u < unit_state_.size(); ++u) release_unit(u);
}

std::vector<at::Tensor> ZeroShards::unit_tensors(size_t u) const {
  TORCH_CHECK_VALUE(u < unit_buckets_.size(), "ZeroOptimizer: unit ", u, " is out of range [0, ",
                    unit_buckets_.size(), ")");
  std::vector<at::Tensor> out;
  for (size_t k : unit_buckets_[u])
    for (const auto& slot : bucket(k).slots) out.push_back(slot.param);
  return out;
}

int64_t ZeroShards::gathered_bytes() const {
  int64_t bytes = 0;
  for (size_t k = 0; k < flats_.size(); ++k)
    bytes += static_cast<int64_t>(bucket(k).data.storage().nbytes());
  return options_.stage == 3 ? bytes : 0;
}

namespace {
void check_unit_call(const char* what, size_t u, size_t count, int stage) {
  TORCH_CHECK_VALUE(stage == 3, "ZeroOptimizer.", what, ": units exist at stage 3 only (this optimizer is stage ",
                    stage, ")");
  TORCH_CHECK_VALUE(u < count, "ZeroOptimizer.", what, ": unit ", u, " is out of range [0, ", count, ")");
}
}  // namespace

void ZeroShards::unit_pre_forward(size_t u) {
  check_unit_call("unit_pre_forward", u, unit_state_.size(), options_.stage);
  if (in_backward()) {  // a recomputation inside backward needs u only: its neighbours are the backward's
    wait_unit(u, GatherFor::Backward);
    return;
  }
  const GatherFor why = c10::GradMode::is_enabled() ? GatherFor::Forward : GatherFor::ForwardNoGrad;
  gather_unit(u, why);
  for (size_t j = 1; j <= static_cast<size_t>(options_.prefetch) && u + j < unit_state_.size(); ++j)
    gather_unit(u + j, why);
  wait_unit(u, why);
}

void ZeroShards::unit_post_forward(size_t u) {
  check_unit_call("unit_post_forward", u, unit_state_.size(), options_.stage);
  if (in_backward()) return;  // recomputed for the backward that follows: its gradients release it
  if (options_.reshard_after_forward || !c10::GradMode::is_enabled()) release_unit(u);
}

void ZeroShards::unit_pre_backward(size_t u) {
  check_unit_call("unit_pre_backward", u, unit_state_.size(), options_.stage);
  TORCH_CHECK(in_backward(), "ZeroOptimizer.unit_pre_backward: called outside a backward pass");
  begin_pass();  // its end frees every unit and reduces what is left
  gather_unit(u, GatherFor::Backward);
  for (size_t j = 1; j <= static_cast<size_t>(options_.prefetch) && j <= u; ++j)
    gather_unit(u - j, GatherFor::Backward);
  wait_unit(u, GatherFor::Backward);
}

std::vector<at::Tensor> ZeroShards::full_parameters(int to) {
  dist::Agreement agreement("ZeroOptimizer.full_parameters");
  agreement.check([&] {
    TORCH_CHECK_VALUE(options_.stage == 3, "ZeroOptimizer.full_parameters: for stage 3 (the parameters of stages 1 "
                      "and 2 are whole on every rank: read the model)");
    TORCH_CHECK_VALUE(to >= 0 && to < comm_.size(), "ZeroOptimizer.full_parameters: to must be a rank in [0, ",
                      comm_.size(), "), got ", to);
    TORCH_CHECK(!in_backward(), "ZeroOptimizer.full_parameters: called during a backward pass");
  });
  agreement.field("to", std::to_string(to));
  agreement.exchange(comm_);
  std::vector<at::Tensor> out(comm_.rank() == to ? param_count() : 0);
  c10::NoGradGuard no_grad;
  for (size_t u = 0; u < unit_state_.size(); ++u) {  // one unit on the device at a time
    const bool was_full = unit_state_[u] == UnitState::Full;
    wait_unit(u, GatherFor::Read);
    if (comm_.rank() == to)
      for (size_t k : unit_buckets_[u])
        for (size_t i = 0; i < full_views_[k].size(); ++i)
          out[param_of_slot_[k][i]] = full_views_[k][i].to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
    if (!was_full) release_unit(u);
  }
  return out;
}

void ZeroShards::load_full_parameters(const std::vector<at::Tensor>& values) {
  // Every rank checks, then the ranks agree that they load the same values: a dict loaded on some ranks only,
  // or different dicts, would leave each rank's shard from another model.
  dist::Agreement agreement("ZeroOptimizer.load_full_parameters");
  agreement.check([&] {
    TORCH_CHECK_VALUE(options_.stage == 3, "ZeroOptimizer.load_full_parameters: for stage 3 (load a stage 1 or 2 "
                      "model's parameters into the model itself)");
    TORCH_CHECK_VALUE(values.size() == param_count(), "ZeroOptimizer.load_full_parameters: ", values.size(),
                      " tensors for ", param_count(), " parameters");
    TORCH_CHECK(!in_backward() && !pass_active_, "ZeroOptimizer.load_full_parameters: called during a backward pass");
    for (size_t i = 0; i < values.size(); ++i) {
      const auto [k, slot] = slot_of_param_[i];
      const at::Tensor& like = full_views_[k][slot];
      TORCH_CHECK_VALUE(values[i].defined() && values[i].sizes() == like.sizes() && values[i].is_floating_point(),
                        "ZeroOptimizer.load_full_parameters: values[", i, "] must be a floating tensor of shape ",
                        like.sizes(), " (", describe(k, slot), "), got ",
                        values[i].defined() ? c10::str(values[i].scalar_type(), " of shape ", values[i].sizes())
                                            : std::string("none"));
    }
  });
  if (!agreement.failed())
    agreement.check([&] { agreement.field("values loaded (fingerprint)", dist::fingerprint(values)); });
  agreement.exchange(comm_);
  release_units();  // gathered copies would be stale
  c10::NoGradGuard no_grad;
  const int64_t rank = comm_.rank();
  for (size_t i = 0; i < values.size(); ++i) {
    const auto [k, slot] = slot_of_param_[i];
    const auto& s = bucket(k).slots[slot];
    const int64_t size = shards_[k].numel(), begin = rank * size, end = begin + size;
    const int64_t lo = std::max(begin, s.offset), hi = std::min(end, s.offset + s.numel);
    if (lo >= hi) continue;  // this parameter lies outside this rank's shard
    const at::Tensor part = values[i].detach().reshape({-1}).narrow(0, lo - s.offset, hi - lo);
    // 16-bit: the master takes the values as given, the rounded shard the same values rounded.
    shards_[k].detach().narrow(0, lo - begin, hi - lo).copy_(part);
    if (separate_shard(k)) low_shards_[k].narrow(0, lo - begin, hi - lo).copy_(part);
  }
}

}  // namespace gpuops::optim
