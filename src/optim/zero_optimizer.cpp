// gpuops::optim::ZeroOptimizer (zero_optimizer.h): FlatParams + Communicator around our AdamW, which steps
// one shard parameter per flat buffer. No element math here: the step is AdamW's.
#include "gpuops/zero_optimizer.h"

#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "gpuops/fused_adam.h"

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

AdamOptions step_options_of(const AdamWOptions& o) {
  AdamOptions a;
  a.lr = o.lr();
  std::tie(a.beta1, a.beta2) = o.betas();
  a.eps = o.eps();
  a.weight_decay = o.weight_decay();
  a.amsgrad = o.amsgrad();
  a.maximize = o.maximize();
  return a;
}

}  // namespace

ZeroOptimizer::Parts ZeroOptimizer::build(const std::vector<at::Tensor>& params, const dist::Communicator& comm,
                                          int stage, const AdamWOptions& options) {
  // Local checks first (the same on every rank given the same arguments), then the one collective, then
  // FlatParams, which checks everything before it changes a parameter.
  TORCH_CHECK_VALUE(stage == 1 || stage == 2, "ZeroOptimizer: stage must be 1 (optimizer state sharded) or 2 "
                    "(optimizer state and gradients sharded), got ", stage);
  check_adam_options(step_options_of(options), "ZeroOptimizer");
  TORCH_CHECK_VALUE(!options.capturable(), "ZeroOptimizer: capturable=true is not supported (the step "
                    "communicates); leave it false");
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK_VALUE(!params[i].defined() || params[i].scalar_type() == at::kFloat, "ZeroOptimizer: params[", i,
                      "] is ", params[i].scalar_type(), "; only float32 parameters are supported so far (16-bit "
                      "parameters with an fp32 master shard and fp32 gradient reduction are not built yet)");
  }
  const int n = comm.size();
  // Every rank's [count, hash]: ranks that disagree all raise the same error, nothing changed.
  at::Tensor mine = at::tensor({static_cast<int64_t>(params.size()), params_hash(params)}, at::kLong);
  at::Tensor all = at::empty({2 * n}, at::kLong);
  auto work = const_cast<dist::Communicator&>(comm).all_gather(mine, all);
  work.wait();
  const auto* v = all.data_ptr<int64_t>();
  for (int r = 1; r < n; ++r) {
    TORCH_CHECK_VALUE(v[2 * r] == v[0] && v[2 * r + 1] == v[1], "ZeroOptimizer: params differ across ranks: rank 0 "
                      "passed ", v[0], " parameters (shape hash ", v[1], "), rank ", r, " passed ", v[2 * r],
                      " (shape hash ", v[2 * r + 1], "); every rank must pass the same parameters (count, shapes, "
                      "dtypes), in the same order");
  }
  FlatParamsOptions flat_options;
  flat_options.world_size = n;
  Parts parts;
  parts.flat = std::make_unique<FlatParams>(params, flat_options);
  for (const auto& bucket : parts.flat->buckets()) {
    const int64_t s = bucket.data.numel() / n;
    at::Tensor shard = alias(bucket.data, comm.rank() * s, s).requires_grad_(true);
    parts.shards.push_back(shard);
    if (stage == 2) parts.shard_grads.push_back(at::zeros({s}, bucket.data.options()));
  }
  return parts;
}

ZeroOptimizer::ZeroOptimizer(std::vector<at::Tensor> params, dist::Communicator communicator, int stage,
                             AdamWOptions options)
    : ZeroOptimizer(build(params, communicator, stage, options), communicator, stage, options) {}

ZeroOptimizer::ZeroOptimizer(Parts parts, dist::Communicator communicator, int stage, AdamWOptions options)
    : AdamW(parts.shards, std::move(options)),
      comm_(std::move(communicator)),
      stage_(stage),
      flat_(std::move(parts.flat)),
      shards_(std::move(parts.shards)),
      shard_grads_(std::move(parts.shard_grads)) {
  install_shard_grads();
}

const char* ZeroOptimizer::name() const { return "ZeroOptimizer"; }

void ZeroOptimizer::install_shard_grads() {
  const int n = comm_.size();
  for (size_t k = 0; k < shards_.size(); ++k) {
    const at::Tensor& grad = flat_->buckets()[k].grad;
    const int64_t s = shards_[k].numel();
    shards_[k].mutable_grad() = stage_ == 2 ? shard_grads_[k] : alias(grad, comm_.rank() * s, s);
    (void)n;
  }
}

void ZeroOptimizer::zero_grad(bool /*set_to_none*/) {
  flat_->zero_grad();  // stage 2: allocates the flat gradients again
  install_shard_grads();
  reduced_ = false;
  stepped_ = false;
}

void ZeroOptimizer::prepare_gradients() {
  if (reduced_) return;
  TORCH_CHECK(!stepped_, "ZeroOptimizer: the gradients were spent by the last step; call zero_grad() (of this "
              "optimizer) before the next backward");
  bool ours = true;
  for (size_t k = 0; k < shards_.size(); ++k) ours = ours && shards_[k].grad().defined();
  TORCH_CHECK(ours && flat_->intact(), "ZeroOptimizer: the parameters' gradients are no longer the flat buffer's "
              "views (something set them to None, e.g. torch::optim::Optimizer::zero_grad, which is not virtual); "
              "call ZeroOptimizer::zero_grad() before backward");
  c10::NoGradGuard no_grad;
  // Fixed order: every buffer launched in turn, then waited in turn (results do not depend on timing).
  std::vector<dist::Work> works;
  for (size_t k = 0; k < shards_.size(); ++k) {
    const at::Tensor& grad = flat_->buckets()[k].grad;
    works.push_back(stage_ == 2 ? comm_.reduce_scatter(grad, shard_grads_[k], dist::ReduceOp::Average)
                                : comm_.reduce_scatter(grad, dist::ReduceOp::Average));
  }
  for (auto& w : works) w.wait();
  if (stage_ == 2) flat_->release_grads();  // only the shard is kept
  reduced_ = true;
}

at::Tensor ZeroOptimizer::global_found_inf(const at::Tensor& found_inf) {
  at::Tensor flag = found_inf.detach().to(at::kFloat).contiguous().clone();
  comm_.all_reduce(flag, dist::ReduceOp::Max).wait();
  return flag.reshape(found_inf.sizes());
}

at::Tensor ZeroOptimizer::global_grad_norm(const at::Tensor& norm) {
  at::Tensor squares = norm.detach().to(at::kDouble).square().reshape({1}).contiguous();
  comm_.all_reduce(squares, dist::ReduceOp::Sum).wait();
  return squares.sqrt().to(norm.scalar_type()).reshape(norm.sizes());
}

at::Tensor ZeroOptimizer::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    c10::AutoGradMode enable_grad(true);
    loss = closure();
  }
  prepare_gradients();
  step_scaled(std::nullopt, std::nullopt);
  return loss;
}

void ZeroOptimizer::step_group(size_t index, std::vector<at::Tensor>& params,
                               const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  prepare_gradients();
  AdamW::step_group(index, params, grad_scale, found_inf);  // the fused step on this rank's shards
  std::vector<dist::Work> works;
  for (const auto& bucket : flat_->buckets()) works.push_back(comm_.all_gather(bucket.data));
  for (auto& w : works) w.wait();
  reduced_ = false;
  stepped_ = true;
}

int64_t ZeroOptimizer::state_bytes() const {
  int64_t bytes = 0;
  for (const auto& [key, state] : state_) {
    const auto& s = static_cast<const AdamWParamState&>(*state);
    for (const at::Tensor& t : {s.step(), s.master_param(), s.exp_avg(), s.exp_avg_sq(), s.max_exp_avg_sq()})
      if (t.defined()) bytes += static_cast<int64_t>(t.nbytes());
  }
  return bytes;
}

int64_t ZeroOptimizer::gradient_bytes() const {
  int64_t bytes = 0;
  for (const auto& bucket : flat_->buckets())
    if (bucket.grad.defined()) bytes += static_cast<int64_t>(bucket.grad.nbytes());
  for (const at::Tensor& g : shard_grads_) bytes += static_cast<int64_t>(g.nbytes());
  return bytes;
}

}  // namespace gpuops::optim
