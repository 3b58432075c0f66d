// gpuops::optim::ZeroShards (zero_optimizer.h), the step side: buckets (one flat buffer each), shards and
// masters, the reduction of the gradients (at the step, or from autograd hooks during backward), the global
// flag and norm, the all-gather. No optimizer math here.
#include <algorithm>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gpuops/agreement.h"
#include "gpuops/device.h"
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

FlatParamsOptions padded_to(int world_size);

// Stage 3's options; the units must number 0 .. U-1, each holding a parameter.
void check_units(const ZeroOptions& options, size_t n_params) {
  TORCH_CHECK_VALUE(options.prefetch >= 0 && options.prefetch <= 64, "ZeroOptimizer: prefetch must be in [0, 64] "
                    "units, got ", options.prefetch);
  if (options.stage != 3) {
    TORCH_CHECK_VALUE(options.units.empty(), "ZeroOptimizer: units are for stage 3 (parameters sharded), got ",
                      options.units.size(), " with stage ", options.stage);
    TORCH_CHECK_VALUE(!options.device, "ZeroOptimizer: device is for stage 3 (the parameters of stages 1 and 2 "
                      "stay where they are), got ", *options.device, " with stage ", options.stage);
    return;
  }
  TORCH_CHECK_VALUE(!options.overlap_param_gather, "ZeroOptimizer: overlap_param_gather is for stages 1 and 2; stage "
                    "3 gathers each unit before it runs (prefetch sets how far ahead)");
  if (options.device) {  // the buffers move there; the collectives must reach it
    TORCH_CHECK_VALUE(options.device->is_cpu() || options.device->is_cuda(), "ZeroOptimizer: device must be a CPU "
                      "or CUDA device, got ", *options.device);
    const int64_t gpus = options.device->is_cuda() && at::hasCUDA() ? at::detail::getCUDAHooks().deviceCount() : 0;
    TORCH_CHECK_VALUE(!options.device->is_cuda() || (gpus > 0 && options.device->index() < gpus),
                      "ZeroOptimizer: device ", *options.device, " is not available: this process sees ", gpus,
                      " CUDA device(s)", at::hasCUDA() ? "" : " (no CUDA driver or device)");
  }
  if (options.units.empty()) return;
  TORCH_CHECK_VALUE(options.units.size() == n_params, "ZeroOptimizer: ", options.units.size(), " units for ",
                    n_params, " parameters; give the unit of every parameter, or none (one unit)");
  // Each unit holds a parameter, so there are at most n_params of them: a larger number is refused before
  // anything is sized by it (near INT64_MAX the count would wrap; 2^40 would ask for a terabit table).
  for (size_t i = 0; i < options.units.size(); ++i)
    TORCH_CHECK_VALUE(options.units[i] >= 0 && options.units[i] < static_cast<int64_t>(n_params), "ZeroOptimizer: "
                      "units[", i, "] must be in [0, ", n_params, ") (units number 0 .. U-1, each holding a "
                      "parameter), got ", options.units[i]);
  const int64_t count = *std::max_element(options.units.begin(), options.units.end()) + 1;
  std::vector<bool> used(static_cast<size_t>(count), false);
  for (int64_t unit : options.units) used[static_cast<size_t>(unit)] = true;
  const auto empty = std::find(used.begin(), used.end(), false);
  TORCH_CHECK_VALUE(empty == used.end(), "ZeroOptimizer: unit ", empty - used.begin(), " has no parameter; number "
                    "the units 0 .. U-1 (", count, " here), each holding at least one parameter");
}

// Offload: the host memory this rank's shard takes (fp32 masters and gradients, the optimizer's state), up
// front against what the host can still give, so that a short host fails here, not mid-run.
void check_host_memory(const std::vector<at::Tensor>& params, int world_size, double state_bytes_per_element) {
  int64_t elements = 0;
  for (const at::Tensor& p : params) elements += p.defined() ? p.numel() : 0;
  const double per_rank = static_cast<double>(elements) / world_size;
  const double needed = per_rank * (4 + 4 + state_bytes_per_element), headroom = host_memory_headroom_bytes();
  const double gib = 1 << 30;
  TORCH_CHECK_VALUE(needed <= headroom, "ZeroOptimizer: offload='cpu' needs about ", needed / gib, " GiB of host "
                    "memory on this rank (its 1/", world_size, " of ", elements, " parameter elements: fp32 masters 4, "
                    "gradients 4 and optimizer state ", state_bytes_per_element, " bytes each), but ", headroom / gib,
                    " GiB is left (the least of MemAvailable, the cgroup's memory.max and ulimit -v/-d); use more "
                    "ranks, state_bits=8, or a host with more memory");
}

// This rank's checks of the arguments; nothing changes.
void check_arguments(const std::vector<at::Tensor>& params, const ZeroOptions& options, int world_size,
                     double state_bytes_per_element) {
  TORCH_CHECK_VALUE(options.stage >= 1 && options.stage <= 3, "ZeroOptimizer: stage must be 1 (optimizer state "
                    "sharded), 2 (optimizer state and gradients sharded) or 3 (parameters too), got ", options.stage);
  check_units(options, params.size());
  TORCH_CHECK_VALUE(options.bucket_bytes >= 1, "ZeroOptimizer: bucket_bytes must be >= 1, got ", options.bucket_bytes);
  TORCH_CHECK_VALUE(options.param_names.empty() || options.param_names.size() == params.size(), "ZeroOptimizer: ",
                    options.param_names.size(), " param_names for ", params.size(), " parameters; give one name per "
                    "parameter, or none");
  for (size_t i = 0; i < options.param_names.size(); ++i) {  // names are stored in the shard files, one per line
    const std::string& name = options.param_names[i];
    TORCH_CHECK_VALUE(!name.empty() && name.find_first_of(std::string("\n\r\0", 3)) == std::string::npos,
                      "ZeroOptimizer: param_names[", i, "] must be a non-empty name without line breaks or NUL "
                      "bytes, got '", name.substr(0, 80), "'");
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const auto dtype = params[i].defined() ? params[i].scalar_type() : at::kFloat;
    TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, "ZeroOptimizer: params[",
                      i, "] is ", dtype, "; accepted: float32, or float16/bfloat16 (stepped on fp32 master shards)");
    TORCH_CHECK_VALUE(!params[i].defined() || params[i].numel() > 0, "ZeroOptimizer: params[", i, "] has no "
                      "elements (shape ", params[i].sizes(), "); leave it out of the optimizer");
    TORCH_CHECK_VALUE(!params[i].defined() || params[i].is_cpu() || params[i].is_cuda(), "ZeroOptimizer: ",
                      options.param_names.empty() ? "params[" + std::to_string(i) + "]" : "'" + options.param_names[i] + "'",
                      " is on ", params[i].device(), "; accepted: parameters with values on the CPU or a CUDA device "
                      "(a meta model is materialised first, e.g. with to_empty() and its initialisation)");
  }
  FlatParams::check(params, padded_to(world_size));
  if (options.offload == ZeroOptions::Offload::Cpu) check_host_memory(params, world_size, state_bytes_per_element);
}

FlatParamsOptions padded_to(int world_size) {
  FlatParamsOptions o;
  o.world_size = world_size;
  return o;
}

// A parameter that goes into a buffer laid out in whole state blocks.
bool takes_blocks(const at::Tensor& p, const StateBlocks& blocks) {
  return blocks.block > 0 && p.numel() >= blocks.min_numel;
}

// Such a buffer's layout: every parameter on a block, every shard whole blocks.
FlatParamsOptions blocked_layout(int world_size, const StateBlocks& blocks, at::ScalarType dtype) {
  FlatParamsOptions o = padded_to(world_size);
  o.alignment_bytes = blocks.block * static_cast<int64_t>(c10::elementSize(dtype));
  return o;
}

// Stage 3: one bucket per unit, dtype, device and state layout (blocked or not), the last unit's first
// (backward's order); within a bucket the parameters keep their order.
std::vector<std::vector<at::Tensor>> unit_buckets_of(const std::vector<at::Tensor>& params,
                                                     const std::vector<int64_t>& units, const StateBlocks& blocks) {
  std::vector<std::vector<at::Tensor>> buckets;
  const int64_t count = units.empty() ? 1 : *std::max_element(units.begin(), units.end()) + 1;
  for (int64_t u = count; u-- > 0;) {
    const size_t first = buckets.size();
    for (size_t i = 0; i < params.size(); ++i) {
      if (!units.empty() && units[i] != u) continue;
      auto same = std::find_if(buckets.begin() + static_cast<std::ptrdiff_t>(first), buckets.end(), [&](const auto& b) {
        return b.front().scalar_type() == params[i].scalar_type() && b.front().device() == params[i].device() &&
               takes_blocks(b.front(), blocks) == takes_blocks(params[i], blocks);
      });
      if (same == buckets.end()) {
        buckets.emplace_back();
        same = buckets.end() - 1;
      }
      same->push_back(params[i]);
    }
  }
  return buckets;
}

// The parameters cut into buckets, in reverse order (backward's), each of one dtype and device and at most
// `cap` bytes unless one parameter is larger; within a bucket the parameters keep their order. Those laid out
// in state blocks first (most of the bytes: their reductions overlap the backward), then the others.
std::vector<std::vector<at::Tensor>> buckets_of(const std::vector<at::Tensor>& params, int64_t cap,
                                                const StateBlocks& blocks) {
  std::vector<const at::Tensor*> order;
  for (const bool blocked : {true, false})
    for (auto it = params.rbegin(); it != params.rend(); ++it)
      if (takes_blocks(*it, blocks) == blocked) order.push_back(&*it);
  std::vector<std::vector<at::Tensor>> buckets;
  int64_t bytes = 0;
  for (const at::Tensor* next : order) {
    const at::Tensor& p = *next;
    const int64_t n = static_cast<int64_t>(p.numel()) * static_cast<int64_t>(p.element_size());
    const bool fresh = buckets.empty() || buckets.back().front().scalar_type() != p.scalar_type() ||
                       buckets.back().front().device() != p.device() ||
                       takes_blocks(buckets.back().front(), blocks) != takes_blocks(p, blocks) || bytes + n > cap;
    if (fresh) {
      buckets.emplace_back();
      bytes = 0;
    }
    buckets.back().insert(buckets.back().begin(), p);
    bytes += n;
  }
  return buckets;
}

// The ZeroShards alive now, by a key never reused (an address may be: a new optimizer where the old one was).
std::mutex& live_mutex() {
  static std::mutex m;
  return m;
}
std::unordered_map<int64_t, ZeroShards*>& live_shards() {
  static std::unordered_map<int64_t, ZeroShards*> live;
  return live;
}
int64_t remember_live(ZeroShards* shards) {
  static int64_t next = 0;
  std::lock_guard<std::mutex> lock(live_mutex());
  live_shards()[++next] = shards;
  return next;
}
void forget_live(int64_t key) {
  std::lock_guard<std::mutex> lock(live_mutex());
  live_shards().erase(key);
}

}  // namespace

ZeroShards::ZeroShards(const std::vector<at::Tensor>& params, dist::Communicator communicator, ZeroOptions options,
                       dist::Agreement agreement, StateBlocks blocks, double state_bytes_per_element)
    // (the layout is agreed below: no per-call checks)
    : comm_(communicator.unchecked()), options_(options), blocks_(blocks) {
  // Every rank checks its arguments, then one exchange (agreement.h): a failure on any rank, or arguments that
  // differ, raise on every rank before a parameter changes. FlatParams' checks run over the whole list, so that
  // a bad parameter in a later bucket cannot leave earlier ones flattened.
  agreement.check([&] { check_arguments(params, options_, comm_.size(), state_bytes_per_element); });
  if (!agreement.failed()) {
    agreement.field("parameters (count, shapes, dtypes)",
                    fmt::format("{} tensors, fingerprint {:016x}", params.size(), params_hash(params)));
    // (torch.manual_seed alike on every rank before the model is built, or one checkpoint loaded by all)
    agreement.check([&] { agreement.field("initial parameter values", dist::fingerprint(params)); });
  }
  std::string names;
  for (const auto& name : options_.param_names) names += name + "\n";
  const auto& n = options_.param_names;
  agreement.field("param_names", n.empty() ? "none" : fmt::format("{} names, '{}' ... '{}', fingerprint {}", n.size(),
                                                                  n.front(), n.back(), dist::fingerprint(names)))
      .field("stage", std::to_string(options_.stage))
      .field("bucket_bytes", std::to_string(options_.bucket_bytes))
      .field("reduce_in_backward", options_.reduce_in_backward ? "true" : "false")
      .field("overlap_param_gather", options_.overlap_param_gather ? "true" : "false")
      .field("units", fmt::format("{} parameters' units, fingerprint {}", options_.units.size(),
                                  dist::fingerprint(fmt::format("{}", fmt::join(options_.units, ",")))))
      .field("prefetch", std::to_string(options_.prefetch))
      .field("reshard_after_forward", options_.reshard_after_forward ? "true" : "false")
      .field("check_unit_order", options_.check_unit_order ? "true" : "false")
      .field("device type", options_.device ? c10::DeviceTypeName(options_.device->type(), true) : "the parameters'")
      .field("state blocks", fmt::format("{} elements, parameters of {} or more", blocks_.block, blocks_.min_numel))
      .field("offload", offloaded() ? "cpu" : "none")
      .propose("optimizer id", dist::random_id());
  id_ = agreement.exchange(comm_).at(0).second;
  const bool stage3 = options_.stage == 3;
  std::vector<at::Tensor> parked;  // stage 3: this rank's shard of each bucket, taken before its buffer is freed
  for (const auto& group : stage3 ? unit_buckets_of(params, options_.units, blocks_)
                                  : buckets_of(params, options_.bucket_bytes, blocks_)) {
    const bool blocked = takes_blocks(group.front(), blocks_);
    blocked_.push_back(blocked);
    flats_.push_back(std::make_unique<FlatParams>(
        group, blocked ? blocked_layout(comm_.size(), blocks_, group.front().scalar_type()) : padded_to(comm_.size())));
    if (stage3) parked.push_back(park(flats_.size() - 1));  // one unit's full copy at a time
  }
  // params[i] -> (bucket, slot).
  for (const at::Tensor& p : params) {
    for (size_t k = 0; k < flats_.size(); ++k) {
      const auto& slots = bucket(k).slots;
      const auto found = std::find_if(slots.begin(), slots.end(), [&](const FlatParams::Slot& s) {
        return s.param.unsafeGetTensorImpl() == p.unsafeGetTensorImpl();
      });
      if (found != slots.end()) slot_of_param_.emplace_back(k, static_cast<size_t>(found - slots.begin()));
    }
  }
  TORCH_INTERNAL_ASSERT(slot_of_param_.size() == params.size());
  for (size_t i = 0; i < params.size(); ++i) bucket_of_[params[i].unsafeGetTensorImpl()] = slot_of_param_[i].first;
  gathers_.resize(flats_.size());
  param_of_slot_.resize(flats_.size());
  for (size_t k = 0; k < flats_.size(); ++k) param_of_slot_[k].resize(bucket(k).slots.size());
  for (size_t i = 0; i < slot_of_param_.size(); ++i) param_of_slot_[slot_of_param_[i].first][slot_of_param_[i].second] = i;
  c10::NoGradGuard no_grad;
  for (size_t k = 0; k < flats_.size(); ++k) {
    const at::Tensor shard = stage3 ? parked[k] : data_shard(k);
    // A float32 bucket's shard is stepped in place; a 16-bit one through its fp32 master. Stage 3 keeps the
    // shard apart from the flat buffer, whose storage exists only while the unit is gathered.
    // Offload: every shard parameter an fp32 copy in host memory, its gradient too.
    shards_.push_back(offloaded()     ? host_like(shard).copy_(shard).requires_grad_(true)
                      : is_master(k)  ? shard.to(at::kFloat).requires_grad_(true)
                      : stage3        ? shard.requires_grad_(true)
                                      : alias(bucket(k).data, comm_.rank() * shard.numel(), shard.numel())
                                           .requires_grad_(true));
    low_shards_.push_back(stage3 && separate_shard(k) ? shard : at::Tensor());
    const bool separate = options_.stage >= 2 || separate_shard(k) || options_.reduce_in_backward;
    shard_grads_.push_back(!separate    ? at::Tensor()
                           : offloaded() ? host_like(shard).zero_()
                                         : at::zeros_like(shards_.back()));
  }
  copy_begin_s_.assign(flats_.size(), 0.0);
  grad_copied_.resize(flats_.size());  // (a backward may come before the first zero_grad)
  versions_.resize(flats_.size());
  ready_.assign(flats_.size(), 0);
  accumulated_.assign(flats_.size(), false);
  reduced_.resize(flats_.size());
  if ((options_.reduce_in_backward && options_.stage == 2) || stage3)
    for (auto& f : flats_) f->release_grads();  // a bucket's gradient exists from its first gradient on
  grad_versions_.resize(flats_.size());
  for (size_t k = 0; k < flats_.size(); ++k) {
    has_grad_.emplace_back(bucket(k).slots.size(), 0);
    with_grad_.emplace_back(bucket(k).slots.size(), 0);
    counter_class_.emplace_back(bucket(k).slots.size(), 0);
  }
  for (size_t k = 0; k < flats_.size(); ++k) {
    hooks_.emplace_back();
    for (size_t i = 0; i < bucket(k).slots.size(); ++i) hooks_.back().push_back(hook(k, i));
  }
  install_shard_grads();
  for (size_t k = 0; k < flats_.size(); ++k) {
    record_versions(k);
    record_grad_versions(k);
  }
  if (stage3) build_units();  // every unit released: the parameters become placeholders
  live_key_ = remember_live(this);
}

ZeroShards* ZeroShards::find_live(int64_t key) {
  std::lock_guard<std::mutex> lock(live_mutex());
  const auto found = live_shards().find(key);
  return found == live_shards().end() ? nullptr : found->second;
}

ZeroShards::HookKey ZeroShards::hook(size_t k, size_t i) {
  // After backward's accumulation into a gradient: reduce_in_backward's and stage 3's bookkeeping, and the
  // gradient's version, which tells later writes by anyone else (check_gradients).
  auto accumulator = torch::autograd::impl::grad_accumulator(bucket(k).slots[i].param);
  const uintptr_t key = accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
      [this, k, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
        if (options_.reduce_in_backward || options_.stage == 3) on_gradient(k, i);
        has_grad_[k][i] = 1;
        const at::Tensor& grad = bucket(k).slots[i].param.grad();
        grad_versions_[k][i] = grad.defined() ? grad._version() : -1;
        return outputs;
      }));
  return {std::move(accumulator), key};
}

void ZeroShards::rehook(size_t k) {
  // A parameter whose data was replaced in place (torch's C++ Module::load set_s the loaded tensor into it)
  // gets a new gradient accumulator from autograd, without our hook: its gradients would bypass us.
  for (size_t i = 0; i < hooks_[k].size(); ++i) {
    if (!bucket(k).slots[i].param.requires_grad()) continue;  // frozen since: no gradient comes; the hook waits
    const auto now = torch::autograd::impl::try_get_grad_accumulator(bucket(k).slots[i].param);
    if (now == hooks_[k][i].accumulator) continue;
    hooks_[k][i].accumulator->del_post_hook(hooks_[k][i].key);
    hooks_[k][i] = hook(k, i);
  }
}

ZeroShards::~ZeroShards() {
  forget_live(live_key_);
  for (auto& bucket_hooks : hooks_)
    for (auto& h : bucket_hooks) h.accumulator->del_post_hook(h.key);
  try {  // no all-gather may write into the buffers after they are gone
    wait_for_parameters();
  } catch (const std::exception&) {  // a lost peer: the communicator has said so; nothing to finish
  }
}

std::string ZeroShards::describe(size_t k, size_t slot) const {
  const size_t i = param_of_slot_[k][slot];
  const std::string shape = c10::str(param_sizes(k, slot));
  if (options_.param_names.empty()) return "params[" + std::to_string(i) + "] (shape " + shape + ")";
  return "'" + options_.param_names[i] + "' (params[" + std::to_string(i) + "], shape " + shape + ")";
}

at::IntArrayRef ZeroShards::param_sizes(size_t k, size_t slot) const {
  return options_.stage == 3 ? full_views_[k][slot].sizes() : bucket(k).slots[slot].param.sizes();
}

bool ZeroShards::is_master(size_t k) const { return bucket(k).dtype != at::kFloat; }

at::Tensor ZeroShards::data_shard(size_t k) const { return comm_.shard(bucket(k).data); }

void ZeroShards::install_shard_grads() {
  for (size_t k = 0; k < shards_.size(); ++k) {
    const int64_t s = shards_[k].numel();
    shards_[k].mutable_grad() =
        shard_grads_[k].defined() ? shard_grads_[k] : alias(bucket(k).grad, comm_.rank() * s, s);
  }
}

void ZeroShards::record_versions(size_t k) const {
  versions_[k].clear();
  if (!separate_shard(k)) return;
  for (const auto& slot : bucket(k).slots) versions_[k].push_back(slot.param._version());
}

void ZeroShards::record_grad_versions(size_t k) const {
  grad_versions_[k].clear();
  for (const auto& slot : bucket(k).slots)
    grad_versions_[k].push_back(slot.param.grad().defined() ? slot.param.grad()._version() : -1);
}

bool ZeroShards::foreign_reducer_hook(size_t k, size_t i) const {
  const auto accumulator = torch::autograd::impl::try_get_grad_accumulator(bucket(k).slots[i].param);
  if (!accumulator) return false;
  for (const auto& hook : accumulator->post_hooks()) {
    const auto key = reinterpret_cast<uintptr_t>(hook.get());
    const bool ours = std::any_of(hooks_[k].begin(), hooks_[k].end(), [key](const HookKey& h) { return h.key == key; });
    if (!ours && dynamic_cast<const torch::autograd::utils::LambdaPostHook*>(hook.get()) != nullptr) return true;
  }
  return false;
}

void ZeroShards::check_gradients(bool reduced) const {
  const bool several = comm_.size() > 1;
  if (several && !warned_reducer_) {
    for (size_t k = 0; k < flats_.size() && !warned_reducer_; ++k) {
      if (!foreign_reducer_hook(k, 0)) continue;
      warned_reducer_ = warned_changed_before_ = warned_changed_after_ = true;  // the writes below are its own
      TORCH_WARN("ZeroOptimizer: the gradient of ", describe(k, 0), " also goes through another C++ reducer's "
                 "hook, as DistributedDataParallel's: DDP all-reduces every gradient, then ZeroOptimizer "
                 "reduces it again (the same result for twice the traffic and DDP's own copy of the gradients). "
                 "Train the model without the DDP wrapper: ZeroOptimizer reduces the gradients itself (during "
                 "backward, as DDP does, with reduce_in_backward=True).");
    }
  }
  bool& warned = reduced ? warned_changed_after_ : warned_changed_before_;
  if (warned) return;
  size_t changed = 0;
  std::string first;
  for (size_t k = 0; k < flats_.size(); ++k) {
    // Before the reduction a change is this rank's alone; after it, it is lost where the step reads a separate
    // shard (stage 2, 16-bit, reduce_in_backward) and lands in part elsewhere (this rank's shard of the flat one).
    if (!several && !(reduced && shard_grads_[k].defined())) continue;
    const auto& slots = bucket(k).slots;
    for (size_t i = 0; i < slots.size(); ++i) {
      const at::Tensor& grad = slots[i].param.grad();
      if ((grad.defined() ? grad._version() : -1) == grad_versions_[k][i]) continue;
      if (changed++ == 0) first = describe(k, i);
    }
  }
  if (changed == 0) return;
  warned = true;
  const std::string then = reduced ? "after ZeroOptimizer reduced them (GradScaler.unscale_ and clip_grad_norm_ "
                                     "reduce first), so the step reads the reduced shards: the change is lost, or "
                                     "kept in this rank's shard only"
                                   : "before ZeroOptimizer reduced them, so it saw this rank's gradients only "
                                     "(a clip by this rank's norm, a different one on every rank)";
  TORCH_WARN("ZeroOptimizer: the gradients of ", changed, " parameters (the first: ", first, ") were changed in "
             "place after backward, ", then, ". Clipping them with torch.nn.utils.clip_grad_norm_(model."
             "parameters(), max_norm) does this; clip with the optimizer's clip_grad_norm_(max_norm) or a GradScaler's "
             "clip_grad_norm_(optimizer, max_norm), which use the global norm over every rank's shard. (A change "
             "that is the same on every rank before the reduction, such as a division by the accumulation "
             "steps, is safe.)");
}

void ZeroShards::wait_for_bucket(size_t k) const {
  if (!gathers_[k]) return;
  gathers_[k]->wait();
  gathers_[k].reset();
  record_versions(k);
}

void ZeroShards::wait_for_parameters(const std::vector<at::Tensor>& params) const {
  for (const at::Tensor& p : params) {
    const auto found = bucket_of_.find(p.unsafeGetTensorImpl());
    TORCH_CHECK_VALUE(found != bucket_of_.end(), "ZeroOptimizer.wait_for_parameters: a tensor of shape ",
                      p.sizes(), " is not one of this optimizer's parameters");
    wait_for_bucket(found->second);
  }
}

void ZeroShards::wait_for_parameters() const {
  for (size_t k = flats_.size(); k-- > 0;) wait_for_bucket(k);  // the first parameters are in the last bucket
}

void ZeroShards::zero_grad(bool set_to_none) {
  const bool stage3 = options_.stage == 3;
  begin_timeline();  // (offload: a window's copies start with its first backward)
  if (set_to_none) {
    for (auto& flags : has_grad_) std::fill(flags.begin(), flags.end(), 0);
    for (auto& flags : with_grad_) std::fill(flags.begin(), flags.end(), 0);
  }
  if (!stage3) {
    // A model loaded through torch's C++ Module::load points its parameters at the loaded tensors: copy them in,
    // after the gathers that write the buffers. Otherwise the gathers go on (overlap_param_gather: the next
    // forward waits for them). Stage 3's parameters are placeholders; its gathers hook again.
    if (!std::all_of(flats_.begin(), flats_.end(), [](const auto& f) { return f->attached(); })) wait_for_parameters();
    for (auto& f : flats_)
      if (f->reattach() > 0) reattached_ = true;
    for (size_t k = 0; k < flats_.size(); ++k) rehook(k);
  }
  if (options_.reduce_in_backward || stage3) {
    if (pass_abandoned()) abandon_pass();  // a backward that raised: its partial reductions are dropped below
    TORCH_CHECK(!pass_active_, "ZeroOptimizer.zero_grad: called during a backward pass");
    if (stage3) release_units();
    // Stages 2 and 3: a bucket's gradient exists from its first gradient on.
    for (auto& f : flats_) options_.stage >= 2 ? f->release_grads() : f->zero_grad();
    for (auto& g : shard_grads_) g.zero_();
    accumulated_.assign(flats_.size(), false);
  } else {
    for (auto& f : flats_) f->zero_grad();  // stage 2: allocates the flat gradients again
  }
  install_shard_grads();
  for (size_t k = 0; k < flats_.size(); ++k) record_grad_versions(k);
  reduced_grads_ = false;
  stepped_ = false;
}

void ZeroShards::reduce_in_fp32(size_t k, const at::Tensor& out) {
  const at::Tensor& grad = bucket(k).grad;
  const int n = comm_.size();
  const int64_t s = out.numel();
  const at::Tensor rows = grad.view({n, s});  // row r: rank r's shard
  // Chunk c of every rank's shard, in fp32: the reduce-scatter leaves the sum of this rank's chunk. At most
  // two in flight, so the fp32 copies stay bounded whatever the buffer's size.
  std::deque<std::pair<dist::Work, at::Tensor>> in_flight;
  for (int64_t begin = 0; begin < s; begin += kReduceChunk) {
    const int64_t len = std::min(kReduceChunk, s - begin);
    at::Tensor input = rows.narrow(1, begin, len).to(at::kFloat).contiguous().view({-1});
    in_flight.emplace_back(comm_.reduce_scatter(input, out.narrow(0, begin, len), dist::ReduceOp::Average), input);
    if (in_flight.size() > 2) {
      in_flight.front().first.wait();
      in_flight.pop_front();
    }
  }
  for (auto& [work, input] : in_flight) work.wait();
}

void ZeroShards::reduce_gradients() {
  if (reduced_grads_) return;
  TORCH_CHECK(!stepped_, "ZeroOptimizer: the gradients were spent by the last step; call zero_grad() (of this "
              "optimizer) before the next backward");
  // Parameters re-pointed since zero_grad() (torch's C++ Module::load set_s the loaded tensors into them): the
  // backward wrote gradients the buffers never saw (reduce_in_backward: none reduced; the step would skip or
  // use stale values). zero_grad() copies loaded values in; a load between it and the backward is refused.
  if (options_.stage != 3)
    for (size_t k = 0; k < flats_.size(); ++k)
      TORCH_CHECK_VALUE(flats_[k]->attached(), "ZeroOptimizer.step: the parameters of bucket ", k, " (the first: ",
                        describe(k, 0), ") were replaced after zero_grad() (torch's Module::load or set_data), so "
                        "this step's gradients bypassed the optimizer; load the model before zero_grad(), then run "
                        "the backward again. Nothing was stepped");
  if (!options_.reduce_in_backward) agree_with_grad();  // (reducing in the backward: at each pass's end)
  wait_for_parameters();
  if (options_.reduce_in_backward) {  // every backward pass reduced its own gradients
    TORCH_CHECK(!pass_abandoned(), "ZeroOptimizer.step: the last backward raised before it finished, so its "
                "gradients were reduced only in part; call zero_grad() (of this optimizer) and run it again");
    reduced_grads_ = true;
    return;
  }
  const bool stage3 = options_.stage == 3;
  if (stage3) {  // full gradients accumulated locally over the window; units no backward reached give zeros
    TORCH_CHECK(!pass_abandoned(), "ZeroOptimizer.step: the last backward raised before it finished; call "
                "zero_grad() (of this optimizer) and run it again");
    for (size_t k = 0; k < flats_.size(); ++k) ensure_grad(k);
  } else {
    check_gradients(false);
  }
  bool ours = true;
  for (const at::Tensor& shard : shards_) ours = ours && shard.grad().defined();
  for (const auto& f : flats_) ours = ours && (stage3 || f->intact());
  TORCH_CHECK(ours, "ZeroOptimizer: the parameters' gradients are no longer the flat buffer's views (something "
              "set them to None, e.g. torch::optim::Optimizer::zero_grad, which is not virtual); call "
              "ZeroOptimizer::zero_grad() before backward");
  c10::NoGradGuard no_grad;
  begin_timeline();
  // Fixed order: the float32 buckets launched in turn and waited in turn, then the 16-bit ones chunk by chunk.
  // Offload: each bucket reduced on the device (in place, or into a scratch shard), then copied to the host.
  const auto device_shard = [&](size_t k) {
    return at::empty({shards_[k].numel()}, bucket(k).data.options().dtype(at::kFloat));
  };
  std::vector<std::pair<size_t, dist::Work>> works;
  std::vector<at::Tensor> reduced(shards_.size());
  for (size_t k = 0; k < shards_.size(); ++k) {
    if (is_master(k)) continue;
    const at::Tensor& grad = bucket(k).grad;
    const int64_t s = shards_[k].numel();
    if (offloaded()) reduced[k] = options_.stage >= 2 ? device_shard(k) : alias(grad, comm_.rank() * s, s);
    const at::Tensor& out = offloaded() ? reduced[k] : shard_grads_[k];
    works.emplace_back(k, out.defined() && !out.is_alias_of(grad) ? comm_.reduce_scatter(grad, out, dist::ReduceOp::Average)
                                                                  : comm_.reduce_scatter(grad, dist::ReduceOp::Average));
  }
  for (auto& [k, w] : works) {
    w.wait();
    if (offloaded()) send_to_host(k, reduced[k]);
    reduced[k] = at::Tensor();  // (the copy is queued: see send_to_host)
  }
  for (size_t k = 0; k < shards_.size(); ++k) {
    if (!is_master(k)) continue;
    if (!offloaded()) {
      reduce_in_fp32(k, shard_grads_[k]);
      continue;
    }
    reduced[k] = device_shard(k);
    reduce_in_fp32(k, reduced[k]);
    send_to_host(k, reduced[k]);
    reduced[k] = at::Tensor();
  }
  if (options_.stage >= 2)
    for (auto& f : flats_) f->release_grads();  // only the shards are kept
  for (size_t k = 0; k < flats_.size(); ++k) record_grad_versions(k);
  reduced_grads_ = true;
}

// ------------------------------------------------------------------ parameters without a gradient

void ZeroShards::agree_with_grad() {
  std::vector<uint8_t> flags;
  for (const auto& bucket_flags : has_grad_) flags.insert(flags.end(), bucket_flags.begin(), bucket_flags.end());
  if (comm_.size() > 1) {  // a parameter any rank used is stepped everywhere (absent gradients count as zeros)
    at::Tensor any = at::tensor(flags, at::kByte).to(bucket(0).data.device());  // (offload: not the shards')
    comm_.all_reduce(any, dist::ReduceOp::Max).wait();
    any = any.to(at::kCPU);  // read on the host: the runs to step are chosen there
    std::copy(any.data_ptr<uint8_t>(), any.data_ptr<uint8_t>() + any.numel(), flags.begin());
  }
  size_t next = 0;
  for (auto& bucket_flags : with_grad_)
    for (uint8_t& f : bucket_flags) f = flags[next++] != 0;
}

size_t ZeroShards::shard_index(const at::Tensor& shard) const {
  for (size_t k = 0; k < shards_.size(); ++k)
    if (shards_[k].unsafeGetTensorImpl() == shard.unsafeGetTensorImpl()) return k;
  TORCH_CHECK_VALUE(false, "ZeroOptimizer: a tensor of shape ", shard.sizes(), " is not one of its shard parameters");
}

std::vector<ZeroShards::StepRun> ZeroShards::step_runs(size_t k) const {
  const auto& slots = bucket(k).slots;
  const int64_t s = shards_[k].numel(), lo = comm_.rank() * s, hi = lo + s;
  std::vector<StepRun> runs;
  bool every = true;  // every parameter in this shard is stepped
  size_t last = slots.size();  // the last slot added to runs.back()
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t from = std::max(lo, slots[i].offset), to = std::min(hi, slots[i].offset + slots[i].numel);
    if (from >= to) continue;
    if (!with_grad_[k][i]) {
      every = false;
      continue;
    }
    if (last + 1 == i && counter_class_[k][runs.back().slot] == counter_class_[k][i]) {
      runs.back().numel = to - lo - runs.back().offset;  // the padding between two parameters goes along
    } else {
      runs.push_back({from - lo, to - from, i});
    }
    last = i;
  }
  if (every && runs.size() == 1) runs.front() = {0, s, runs.front().slot};  // the whole shard: no view
  return runs;
}

void ZeroShards::advance_counters(size_t k, const at::Tensor& counters, const std::optional<at::Tensor>& found_inf) {
  c10::NoGradGuard no_grad;
  const auto& stepped = with_grad_[k];
  const bool every = std::all_of(stepped.begin(), stepped.end(), [](uint8_t f) { return f != 0; });
  at::Tensor advance = every ? at::ones({}, counters.options())
                             : at::tensor(std::vector<float>(stepped.begin(), stepped.end()), at::kFloat)
                                   .to(counters.device());
  if (found_inf) advance = advance * found_inf->reshape({}).eq(0).to(at::kFloat);  // no sync
  counters.add_(advance);
  if (every) return;
  // Parameters stepped and not stepped part ways: their counters may differ from now on.
  std::map<std::pair<int64_t, uint8_t>, int64_t> classes;
  auto& cls = counter_class_[k];
  for (size_t i = 0; i < cls.size(); ++i)
    cls[i] = classes.emplace(std::make_pair(cls[i], stepped[i]), static_cast<int64_t>(classes.size())).first->second;
}

void ZeroShards::group_counters(size_t k, const at::Tensor& counters) {
  auto& cls = counter_class_[k];
  if (!counters.defined()) {
    std::fill(cls.begin(), cls.end(), 0);
    return;
  }
  const at::Tensor values = counters.detach().to(at::kCPU, at::kDouble).contiguous();
  TORCH_INTERNAL_ASSERT(values.numel() == static_cast<int64_t>(cls.size()), "one step counter per parameter");
  std::map<double, int64_t> classes;
  for (size_t i = 0; i < cls.size(); ++i)
    cls[i] = classes.emplace(values.data_ptr<double>()[i], static_cast<int64_t>(classes.size())).first->second;
}

// ------------------------------------------------------------------ reduce_in_backward

void ZeroShards::on_gradient(size_t k, size_t slot) {
  TORCH_CHECK(!stepped_, "ZeroOptimizer: backward after the step without zero_grad(); call zero_grad() (of this "
              "optimizer) before the next backward");
  TORCH_CHECK(!pass_abandoned(), "ZeroOptimizer: the previous backward raised before it finished, and its "
              "gradients were reduced in part; call zero_grad() (of this optimizer) before the next backward");
  begin_pass();
  const size_t u = options_.stage == 3 ? unit_of_bucket_[k] : 0;
  TORCH_CHECK(options_.stage != 3 || unit_state_[u] == UnitState::Full, "ZeroOptimizer: a gradient of ",
              describe(k, slot), " arrived while its unit ", u, " was not gathered: its unit ran without the "
              "stage-3 hooks (a parameter used outside its unit's forward, or a unit module not given to the "
              "optimizer)");
  // Stage 2 frees a bucket's gradient once reduced: autograd then made this one on its own. Bring it in.
  const bool fresh = !bucket(k).grad.defined();
  flats_[k]->adopt_grad(0, slot);
  if (fresh) record_grad_versions(k);  // every slot's .grad is a new view
  if (++ready_[k] != bucket(k).slots.size()) return;
  if (options_.stage == 3 && ++unit_ready_[u] == unit_buckets_[u].size()) release_unit(u);  // its backward is done
  if (!options_.reduce_in_backward) return;
  while (next_launch_ < flats_.size() && ready_[next_launch_] == bucket(next_launch_).slots.size()) launch(next_launch_++);
}

void ZeroShards::begin_pass() {
  if (pass_active_) return;  // the first hook of this backward pass: finish the pass when the backward ends
  wait_for_parameters();  // buckets no forward read (unused parameters) are written before any reduction
  pass_active_ = true;
  // The engine drops a backward's callbacks when it raises: the token then expires with them, and the pass
  // is known to be abandoned (pass_abandoned).
  auto token = std::make_shared<char>();
  pass_token_ = token;
  torch::autograd::Engine::get_default_engine().queue_callback([this, token] { finish_pass(); });
}

void ZeroShards::launch(size_t k) {
  c10::NoGradGuard no_grad;
  ensure_grad(k);  // no gradient arrived in this pass: zeros
  reduced_[k] = offloaded() ? at::empty({shards_[k].numel()}, bucket(k).data.options().dtype(at::kFloat))
                            : at::empty_like(shard_grads_[k]);
  if (is_master(k)) {
    reduce_in_fp32(k, reduced_[k]);  // chunked, waited inside
    pending_.emplace_back(k, std::nullopt);
  } else {
    pending_.emplace_back(k, comm_.reduce_scatter(bucket(k).grad, reduced_[k], dist::ReduceOp::Average));
  }
  // Bounded memory: at most two buckets in flight; stage 3 one unit (FSDP2's bound: its full gradient, Gloo's
  // copy of it and the reduced shard are what a backward holds beyond the running unit).
  const size_t in_flight = options_.stage == 3 ? 1 : 2;
  while (pending_.size() > in_flight) finish_oldest();
}

void ZeroShards::finish_oldest() {
  auto [k, work] = std::move(pending_.front());
  pending_.pop_front();
  if (work) work->wait();
  c10::NoGradGuard no_grad;
  if (offloaded()) {
    receive_on_host(k, reduced_[k], accumulated_[k]);
  } else {
    accumulated_[k] ? shard_grads_[k].add_(reduced_[k]) : shard_grads_[k].copy_(reduced_[k]);
  }
  accumulated_[k] = true;
  reduced_[k].reset();
  if (options_.stage >= 2) {
    flats_[k]->release_grads();
    record_grad_versions(k);
  } else {
    bucket(k).grad.zero_();
  }
}

bool ZeroShards::pass_abandoned() const {
  // Outside any backward a pass still active is dead (a pass that ends runs finish_pass before backward()
  // returns); inside one, the token tells a dead pass from the one running (a nested backward's included).
  return pass_active_ && (pass_token_.expired() || torch::autograd::get_current_graph_task_id() == -1);
}

void ZeroShards::abandon_pass() {
  for (auto& [k, work] : pending_) {  // the reductions it launched still complete (every rank's collectives)
    if (!work) continue;
    try {
      work->wait();
    } catch (const std::exception&) {  // a lost peer: the communicator has said so
    }
  }
  pending_.clear();
  for (auto& r : reduced_) r.reset();
  ready_.assign(flats_.size(), 0);
  unit_ready_.assign(unit_ready_.size(), 0);
  next_launch_ = 0;
  pass_active_ = false;
}

void ZeroShards::finish_pass() {
  // Units still gathered (prefetched and not run, a unit whose parameters got no gradient) are freed first;
  // buckets that did not complete (parameters unused in this pass) are reduced now, still in order.
  if (options_.stage == 3) release_units();
  if (options_.reduce_in_backward) {
    while (next_launch_ < flats_.size()) launch(next_launch_++);
    while (!pending_.empty()) finish_oldest();
    agree_with_grad();  // here, so that the step itself communicates only its all-gathers
  }
  ready_.assign(flats_.size(), 0);
  unit_ready_.assign(unit_ready_.size(), 0);
  next_launch_ = 0;
  pass_active_ = false;
}

namespace {
const char* combining(int64_t what) {
  switch (what) {
    case 1: return "its overflow flag (gpuops.GradScaler's unscale_ or step)";
    case 2: return "its gradient norm (clip_grad_norm_)";
    case 3: return "its gradient divisor (GradScaler.set_grad_divisor)";
    case 4: return "nothing: it refused to step with a GradScaler other than gpuops.GradScaler (torch.amp.GradScaler "
                   "checks and unscales one rank's unreduced gradients only); its own error says more";
    default: return "something unknown";
  }
}
}  // namespace

at::Tensor ZeroShards::combine(Combine what, const at::Tensor& value) {
  const int n = comm_.size();
  // (offload: a value computed on the host gradients goes where the group gathers: NCCL's device)
  const at::Device device = n > 1 && value.is_cpu() ? comm_.control_device() : value.device();
  const at::Tensor mine = at::stack({value.detach().reshape({}).to(device, at::kDouble),
                                     at::full({}, static_cast<double>(what), value.options().device(device).dtype(at::kDouble))});
  if (n == 1) return mine.narrow(0, 0, 1);
  at::Tensor all = at::empty({2 * n}, mine.options());
  comm_.all_gather(mine, all).wait();
  all = all.view({n, 2});
  if (value.device() != device) all = all.to(value.device());
  if (what == Combine::ForeignScaler) return all.select(1, 0);  // the caller raises its own error
  const at::Tensor kinds = all.select(1, 1).to(at::kCPU).contiguous();  // host-read: raised on every rank
  const double* k = kinds.data_ptr<double>();
  for (int r = 0; r < n; ++r)
    TORCH_CHECK_VALUE(static_cast<int64_t>(k[r]) == static_cast<int64_t>(what), "ZeroOptimizer: the ranks are at "
                      "different points of the step: rank ", comm_.rank(), " combines ",
                      combining(static_cast<int64_t>(what)), ", rank ", r, " ", combining(static_cast<int64_t>(k[r])),
                      ". Every rank must run the same calls in the same order (the same GradScaler, clip_grad_norm_ "
                      "on every rank or none); nothing was stepped");
  return all.select(1, 0);
}

at::Tensor ZeroShards::global_found_inf(const at::Tensor& found_inf) {
  return combine(Combine::FoundInf, found_inf).max().to(at::kFloat).reshape(found_inf.sizes());
}

at::Tensor ZeroShards::global_grad_norm(const at::Tensor& norm) {
  // squares summed in float64, in rank order on every rank: the same bits everywhere
  return combine(Combine::GradNorm, norm.detach().to(at::kDouble).square())
      .sum()
      .sqrt()
      .to(norm.scalar_type())
      .reshape(norm.sizes());
}

at::Tensor ZeroShards::global_divisor(const at::Tensor& divisor) {
  return combine(Combine::Divisor, divisor).mean().to(at::kFloat).reshape(divisor.sizes());
}

void ZeroShards::refuse_step_with_foreign_scaler() {
  reduce_gradients();
  combine(Combine::ForeignScaler, at::zeros({}, at::TensorOptions().device(shards_.front().device())));
}

void ZeroShards::before_step() {
  wait_for_parameters();
  if (options_.stage == 3) return;  // the parameters are the shards: nothing outside can have written them
  check_gradients(true);
  for (size_t k = 0; k < flats_.size(); ++k) record_grad_versions(k);
  c10::NoGradGuard no_grad;
  for (size_t k = 0; k < shards_.size(); ++k) {
    if (!separate_shard(k)) continue;
    const auto& slots = bucket(k).slots;
    bool written = reattached_;
    for (size_t i = 0; i < slots.size(); ++i) written = written || slots[i].param._version() != versions_[k][i];
    if (!written) continue;
    // Element-wise: a master keeps its extra precision where it still rounds to the parameter.
    const at::Tensor data = data_shard(k).to(shards_[k].device());
    at::Tensor& master = shards_[k];
    master.copy_(at::where(master.to(data.scalar_type()).eq(data), master, data.to(at::kFloat)));
  }
  reattached_ = false;
}

void ZeroShards::after_step() {
  ++steps_;
  c10::NoGradGuard no_grad;
  for (size_t k = 0; k < shards_.size(); ++k)
    if (is_master(k) && !offloaded()) param_shard(k).copy_(shards_[k]);  // round to nearest even (offload: sent)
  if (options_.stage == 3) {  // gathered copies are stale: the next forward gathers the new values
    release_units();
    reduced_grads_ = false;
    stepped_ = true;
    return;
  }
  // Launched in forward order (the last bucket holds the first parameters); waited here, or with
  // overlap_param_gather as the next forward reaches each bucket (wait_for_parameters).
  for (size_t k = flats_.size(); k-- > 0;) gathers_[k] = comm_.all_gather(bucket(k).data);
  if (!options_.overlap_param_gather) wait_for_parameters();
  reduced_grads_ = false;
  stepped_ = true;
}

int64_t ZeroShards::gradient_bytes() const {
  int64_t bytes = 0;
  for (size_t k = 0; k < flats_.size(); ++k)
    if (bucket(k).grad.defined()) bytes += static_cast<int64_t>(bucket(k).grad.nbytes());
  for (const at::Tensor& g : shard_grads_)
    if (g.defined()) bytes += static_cast<int64_t>(g.nbytes());
  return bytes;
}

int64_t ZeroShards::master_bytes() const {
  int64_t bytes = 0;
  for (size_t k = 0; k < shards_.size(); ++k)
    if (separate_shard(k)) bytes += static_cast<int64_t>(shards_[k].nbytes());
  return bytes;
}

}  // namespace gpuops::optim
