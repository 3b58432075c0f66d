// gpuops::optim::ZeroOptimizer over Gloo, with real processes (multiprocess.h: the binary re-runs itself as
// each rank, OMP_NUM_THREADS=1). Every rank trains a small MLP for 50 steps on fresh random data of its own,
// with our GradScaler, clipping and gradient accumulation, and also trains the single-process reference
// (our AdamW on the concatenated batch of all ranks, which it regenerates) to compare with, within 10 times the
// distance between that reference and an equally valid one (each rank's loss through its own matmuls). It trains twice
// to check the bits do not depend on timing, checks the ranks agree, and measures its optimizer state.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/autograd.h>

#include "gpuops/communicator.h"
#include "gpuops/estimator/step_phases.h"
#include "gpuops/grad_scaler.h"
#include "gpuops/memory_budget.h"
#include "gpuops/optimizers.h"
#include "gpuops/zero_optimizer.h"
#include "multiprocess.h"
#include "parity_bound.h"

namespace {

using gpuops::amp::GradScaler;
using gpuops::amp::GradScalerOptions;
using gpuops::dist::Communicator;
using gpuops::dist::CommunicatorOptions;
using gpuops::optim::AdamW;
using gpuops::optim::AdamWOptions;
using gpuops::optim::ZeroOptimizer;
using namespace gpuops_test;  // NOLINT: the launch helpers

constexpr int kSteps = 50;
constexpr int kOverflowStep = 20;  // rank 1's data holds an inf at this step
constexpr int64_t kBatch = 6, kIn = 13, kHidden = 31, kOut = 5;  // odd sizes: padding between parameters

// ------------------------------------------------------------------------------------------------------
// Worker side

std::vector<at::Tensor> make_params() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  std::vector<at::Tensor> p = {at::randn({kHidden, kIn}, gen) * 0.3, at::randn({kHidden}, gen) * 0.1,
                               at::randn({kOut, kHidden}, gen) * 0.3, at::randn({kOut}, gen) * 0.1};
  for (auto& t : p) t.requires_grad_(true);
  return p;
}

// Rank r's micro-batch `micro` of step `step`: fresh random data per rank, reproducible by every process.
std::pair<at::Tensor, at::Tensor> batch_of(int step, int micro, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100000 + 1000 * step + 10 * micro + rank);
  at::Tensor x = at::randn({kBatch, kIn}, gen);
  at::Tensor y = at::randn({kBatch, kOut}, gen);
  if (step == kOverflowStep && micro == 0 && rank == 1) x[0][0] = INFINITY;  // one rank overflows: all skip
  return {x, y};
}

at::Tensor loss_of(const std::vector<at::Tensor>& p, const at::Tensor& x, const at::Tensor& y) {
  at::Tensor h = at::tanh(at::addmm(p[1], x, p[0].t()));
  return (at::addmm(p[3], h, p[2].t()) - y).square().mean();
}

AdamWOptions adamw_options() { return AdamWOptions(3e-2).weight_decay(0.05); }

GradScalerOptions scaler_options() {
  GradScalerOptions o;
  o.init_scale = 1024.0;
  o.growth_interval = 7;  // the scale grows during the run
  return o;
}

struct Setup {
  int stage = 1;
  bool hooks = false;  // reduce_in_backward, with small buckets (one per parameter here)
  bool overlap = false;  // overlap_param_gather: the loss waits for each layer's parameters before it reads them
  int accumulation = 2;
  double max_norm = 1.0;  // clipping active on some steps
  int chunks = 1;  // the reference's loss as the mean of this many per-rank losses (another valid order of sums)
};

// One training step's gradient phase: `accumulation` micro-batches, a divisor, clipping, the scaled step.
// Returns whether the norm was clipped.
template <typename Opt, typename BatchFn>
bool train_step(Opt& opt, GradScaler& scaler, const std::vector<at::Tensor>& params, const Setup& s, BatchFn batch) {
  for (int m = 0; m < s.accumulation; ++m) {
    auto [x, y] = batch(m);
    at::Tensor loss = loss_of(params, x, y);
    if (s.chunks > 1) {  // each rank's batch through its own matmuls, as the ranks compute them
      const auto xs = x.chunk(s.chunks), ys = y.chunk(s.chunks);
      loss = loss_of(params, xs[0], ys[0]);
      for (int c = 1; c < s.chunks; ++c) loss = loss + loss_of(params, xs[c], ys[c]);
      loss = loss / s.chunks;
    }
    scaler.scale(loss).backward();
  }
  if (s.accumulation > 1) scaler.set_grad_divisor(opt, at::scalar_tensor(static_cast<double>(s.accumulation)));
  const double norm = scaler.clip_grad_norm_(opt, s.max_norm).template item<double>();
  scaler.step(opt);
  scaler.update();
  return norm > s.max_norm;
}

// `retained`: the bytes the first step allocated and kept, counted by a MemoryBudget (the optimizer state is
// made at the first step; the scaler keeps a few one-element tensors).
std::vector<at::Tensor> train_zero(Communicator& comm, const Setup& s, int64_t* state_bytes, int64_t* flat_numel,
                                   int64_t* retained, std::string* notes) {
  auto params = make_params();
  gpuops::optim::ZeroOptions zero;
  zero.stage = s.stage;
  zero.reduce_in_backward = s.hooks;
  zero.overlap_param_gather = s.overlap;
  if (s.hooks) zero.bucket_bytes = 512;
  ZeroOptimizer opt(params, comm, zero, adamw_options());
  WORKER_CHECK(opt.bucket_count() == (s.hooks ? 4u : 1u), "{} buckets", opt.bucket_count());
  GradScaler scaler(scaler_options());
  const int n = comm.size();
  int64_t total = 0;  // every bucket's elements, padding included
  for (size_t k = 0; k < opt.bucket_count(); ++k) total += opt.bucket(k).data.numel();
  const int64_t shard = total / n;
  // Gradient buffers between zero_grad() and backward: the flat gradient (not in stage 2 with hooks, where a
  // bucket's exists only from its first gradient to its reduction) and the separate fp32 shards.
  const int64_t flat_bytes = s.stage == 2 && s.hooks ? 0 : total * 4;
  const int64_t shard_bytes = s.stage == 2 || s.hooks ? shard * 4 : 0;
  int clipped = 0;
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    WORKER_CHECK(opt.gradient_bytes() == flat_bytes + shard_bytes, "gradient bytes before backward {}, want {}",
                 opt.gradient_bytes(), flat_bytes + shard_bytes);
    std::optional<gpuops::MemoryBudget> budget;
    if (step == 0) budget.emplace();
    comm.reset_traffic();
    clipped += train_step(opt, scaler, params, s, [&](int m) {
                 if (s.overlap) {  // a forward of two layers: the first's parameters, then the second's
                   opt.wait_for_parameters({params[0], params[1]});
                   opt.wait_for_parameters({params[2], params[3]});
                 }
                 return batch_of(step, m, comm.rank());
               }) ? 1 : 0;
    // Traffic per step (ring algorithm): one reduce-scatter and one all-gather of the flat buffer, i.e. one
    // all-reduce of the parameters, plus which parameters have a gradient (an all-reduce of a byte each), and
    // the overflow flag and the squared norm (each an all-gather of two float64 per rank: the value and what it
    // is, ZeroShards::combine). With hooks, one reduce-scatter and one agreement on the gradients per
    // micro-batch.
    const auto t = comm.traffic();
    const int64_t reductions = s.hooks ? s.accumulation : 1;
    // The accumulation's divisor adds a third combine (the mean of the ranks' divisors).
    const int64_t combines = 2 + (s.accumulation > 1 ? 1 : 0);
    WORKER_CHECK(t.reduce_scatter.ring_sent_bytes == reductions * 4 * total * (n - 1) / n &&
                     t.all_gather.ring_sent_bytes == 4 * total * (n - 1) / n + combines * 16 * (n - 1) &&
                     t.all_reduce.calls == reductions && t.all_reduce.payload_bytes == reductions * 4,
                 "step traffic: reduce-scatter {} B, all-gather {} B, {} all-reduces of {} B ({} elements)",
                 t.reduce_scatter.ring_sent_bytes, t.all_gather.ring_sent_bytes, t.all_reduce.calls,
                 t.all_reduce.payload_bytes, total);
    if (step == 0) {
      if (s.overlap) opt.wait_for_parameters();  // Gloo's gather holds a flat copy of the buffer until then
      // Gloo's worker threads drop their references to a collective's buffers (a reduce-scatter's clone, an
      // all-gather's flat copy) a moment after wait() returns: let them settle, up to 0.5 s, before reading
      // what the step kept (a buffer really kept stays and fails the check below). 48: the scaler's few bytes
      // (about 21) and the check's 16 bytes of slack; a straggler of 128 bytes was seen past a bound of 256.
      for (int i = 0; i < 250 && budget->current_bytes() - opt.state_bytes() > 48; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      *retained = budget->current_bytes();
    }
    if (s.stage == 2) {  // after the reduction only the shard is kept
      WORKER_CHECK(opt.gradient_bytes() == shard * 4, "stage 2 keeps {} gradient bytes after the step, want {}",
                   opt.gradient_bytes(), shard * 4);
      for (const auto& p : params) WORKER_CHECK(!p.grad().defined(), "stage 2: a full gradient survived the step");
    }
  }
  opt.wait_for_parameters();  // overlap_param_gather: the last step's gathers
  *state_bytes = opt.state_bytes();
  *flat_numel = total;
  WORKER_CHECK(scaler.skipped_steps() == 1, "{} steps skipped, want the one with an inf on rank 1", scaler.skipped_steps());
  WORKER_CHECK(clipped > 0 && clipped < kSteps - 1, "clipped on {} steps: the test wants some of both", clipped);
  *notes = fmt::format("final scale {}, skipped steps {}, clipped on {} of {} steps", scaler.get_scale(),
                       scaler.skipped_steps(), clipped, kSteps);
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone());
  return out;
}

std::vector<at::Tensor> train_reference(int n, const Setup& s, int64_t* state_bytes, int64_t* retained) {
  auto params = make_params();
  AdamW opt(params, adamw_options());
  GradScaler scaler(scaler_options());
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    std::optional<gpuops::MemoryBudget> budget;
    if (step == 0) budget.emplace();
    train_step(opt, scaler, params, s, [&](int m) {
      std::vector<at::Tensor> xs, ys;
      for (int r = 0; r < n; ++r) {
        auto [x, y] = batch_of(step, m, r);
        xs.push_back(x);
        ys.push_back(y);
      }
      return std::make_pair(at::cat(xs), at::cat(ys));
    });
    if (step == 0) {
      // The reference's gradients are allocated by its first backward (ZeroOptimizer's live in FlatParams).
      for (const auto& p : params) *retained -= static_cast<int64_t>(p.grad().nbytes());
      *retained += budget->current_bytes();
    }
  }
  *state_bytes = 0;
  for (const auto& p : params) {
    const auto& st = static_cast<const gpuops::optim::AdamWParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
    *state_bytes += static_cast<int64_t>(st.exp_avg().nbytes() + st.exp_avg_sq().nbytes() + st.step().nbytes());
  }
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone());
  return out;
}

void scenario_train(Communicator& comm) {
  Setup s;
  s.stage = std::stoi(env_or("GPUOPS_ZERO_STAGE", "1"));
  s.accumulation = std::stoi(env_or("GPUOPS_ZERO_ACCUM", "2"));
  s.hooks = env_or("GPUOPS_ZERO_HOOKS", "0") == "1";
  s.overlap = env_or("GPUOPS_ZERO_OVERLAP", "0") == "1";
  const int n = comm.size();
  int64_t zero_state = 0, zero_state_again = 0, ref_state = 0, total = 0, total_again = 0;
  int64_t retained = 0, retained_again = 0, ref_retained = 0;
  std::string notes, notes_again;
  const auto a = train_zero(comm, s, &zero_state, &total, &retained, &notes);
  const auto b = train_zero(comm, s, &zero_state_again, &total_again, &retained_again, &notes_again);
  const auto ref = train_reference(n, s, &ref_state, &ref_retained);
  // Two runs: the same bits.
  for (size_t i = 0; i < a.size(); ++i) WORKER_CHECK(at::equal(a[i], b[i]), "params[{}] differ between two runs", i);
  // Every rank holds the same parameters.
  at::Tensor flat = at::cat({a[0].flatten(), a[1], a[2].flatten(), a[3]});
  at::Tensor hi = flat.clone(), lo = flat.clone();
  comm.all_reduce(hi, gpuops::dist::ReduceOp::Max).wait();
  comm.all_reduce(lo, gpuops::dist::ReduceOp::Min).wait();
  WORKER_CHECK(at::equal(hi, flat) && at::equal(lo, flat), "the ranks hold different parameters");
  // Single-process training on the concatenated batch, within the distance between it and another equally
  // valid float32 reference, one summing each rank's loss through its own matmuls (parity_bound.h).
  Setup chunked = s;
  chunked.chunks = n;
  int64_t unused_state = 0, unused_retained = 0;
  const auto other = train_reference(n, chunked, &unused_state, &unused_retained);
  const Parity p = parity(a, ref, other);
  const double worst = p.worst, noise = p.noise;
  WORKER_CHECK(p.holds(), "max relative error {} against single-process > {} (the two references: {})", worst,
               p.bound(), noise);
  double moved = 0.0;
  const auto init = make_params();
  for (size_t i = 0; i < a.size(); ++i) moved = std::max(moved, max_rel_error(ref[i], init[i].detach()));
  WORKER_CHECK(moved > 0.1, "training barely moved the parameters ({}): the comparison would prove little", moved);
  // Optimizer state, measured from the state tensors: 1/N of the unsharded moments plus the padding (FlatParams'
  // alignment of each parameter and of the total to N x 16 bytes), plus one float32 step counter per parameter.
  int64_t numel = 0;
  for (const auto& p : ref) numel += p.numel();
  const int64_t moments = zero_state - 4 * static_cast<int64_t>(ref.size()), ref_moments = ref_state - 4 * static_cast<int64_t>(ref.size());
  WORKER_CHECK(zero_state == zero_state_again, "state bytes differ between runs");
  WORKER_CHECK(ref_moments == 8 * numel, "unsharded moments {} bytes for {} parameters", ref_moments, numel);
  WORKER_CHECK(moments * n == 8 * total && total >= numel &&
                   total - numel < 4 * (n * 4 + static_cast<int64_t>(ref.size())),
               "state bytes {} x {} ranks against {} unsharded ({} elements padded to {})", moments, n, ref_moments,
               numel, total);
  // Measured with MemoryBudget: what the first step allocated and kept is the state plus the same few scaler bytes
  // in both (zero: the shard state; reference: the whole state). Up to 16 bytes more on the sharded side: Gloo's
  // worker thread drops its reference to the last collective's tensors (the 8-byte norm, the 4-byte divisor) a
  // moment after wait() returns, so they are sometimes still alive when the budget is read.
  const int64_t scaler_bytes = retained - zero_state, ref_scaler_bytes = ref_retained - ref_state;
  WORKER_CHECK(scaler_bytes >= 0 && scaler_bytes < 256 && scaler_bytes - ref_scaler_bytes >= 0 &&
                   scaler_bytes - ref_scaler_bytes <= 16,
               "MemoryBudget: the first step kept {} bytes (state {}); the reference {} (state {})", retained,
               zero_state, ref_retained, ref_state);
  write_file(fmt::format("{}/result.{}", env_or("GPUOPS_COMM_DIR", "/tmp"), comm.rank()),
             fmt::format("max_rel_err={:.3g} (the two references: {:.3g}); state bytes per rank {} (moments {} x {} "
                         "ranks = {} = 8 x {} padded elements) against {} unsharded ({} elements); MemoryBudget: the "
                         "first step kept {} bytes against {} unsharded; {}",
                         worst, noise, zero_state, moments, n, moments * n, total, ref_state, numel, retained,
                         ref_retained, notes));
}

void scenario_bad_input(Communicator& comm) {
  const int r = comm.rank();
  auto params = make_params();
  std::vector<const void*> before;
  for (const auto& p : params) before.push_back(p.data_ptr());
  const auto unchanged = [&](const char* what) {
    for (size_t i = 0; i < params.size(); ++i)
      WORKER_CHECK(params[i].data_ptr() == before[i] && !params[i].grad().defined(), "{}: params[{}] changed", what, i);
  };
  // A stage other than 1, 2 or 3: named, before any collective.
  for (int stage : {0, 4}) {
    const auto m = value_error_of([&] { ZeroOptimizer(params, comm, stage, adamw_options()); });
    WORKER_CHECK(m.find("stage must be 1") != std::string::npos && m.find(std::to_string(stage)) != std::string::npos,
                 "stage {}: got '{}'", stage, m);
    unchanged("bad stage");
  }
  // An option out of range.
  auto m = value_error_of([&] { ZeroOptimizer(params, comm, 1, AdamWOptions(-1.0)); });
  WORKER_CHECK(m.find("learning rate") != std::string::npos, "lr: got '{}'", m);
  unchanged("bad lr");
  // A dtype without a master path: named.
  std::vector<at::Tensor> wide = params;
  wide[3] = at::zeros({kOut}, at::kDouble).requires_grad_(true);
  m = value_error_of([&] { ZeroOptimizer(wide, comm, 1, adamw_options()); });
  WORKER_CHECK(m.find("params[3] is Double") != std::string::npos, "float64: got '{}'", m);
  unchanged("float64");
  // capturable: the step communicates.
  m = value_error_of([&] { ZeroOptimizer(params, comm, 1, adamw_options().capturable(true)); });
  WORKER_CHECK(m.find("capturable") != std::string::npos, "capturable: got '{}'", m);
  unchanged("capturable");
  // Parameter count differs on the last rank.
  std::vector<at::Tensor> more = params;
  if (r == comm.size() - 1) more.push_back(at::zeros({3}).requires_grad_(true));
  m = value_error_of([&] { ZeroOptimizer(more, comm, 1, adamw_options()); });
  WORKER_CHECK(m.find("the ranks disagree on parameters (count, shapes, dtypes)") != std::string::npos,
               "count: got '{}'", m);
  unchanged("count differs");
  // A shape differs on rank 1.
  std::vector<at::Tensor> other = params;
  if (r == 1) other[2] = at::zeros({kOut + 1, kHidden}).requires_grad_(true);
  m = value_error_of([&] { ZeroOptimizer(other, comm, 2, adamw_options()); });
  WORKER_CHECK(m.find("the ranks disagree on parameters (count, shapes, dtypes)") != std::string::npos &&
                   m.find("rank 1") != std::string::npos,
               "shape: got '{}'", m);
  unchanged("shape differs");
  // The group still agrees on the next collective, and a good optimizer is built after all of that.
  comm.barrier().wait();
  ZeroOptimizer opt(params, comm, 1, adamw_options());
  opt.zero_grad();
  loss_of(params, at::ones({2, kIn}), at::zeros({2, kOut})).backward();
  opt.step();
  // Backward again without zero_grad: the spent gradients are refused, on every rank, before any collective.
  loss_of(params, at::ones({2, kIn}), at::zeros({2, kOut})).backward();
  std::string spent;
  try {
    opt.step();
  } catch (const c10::Error& e) {
    spent = e.what_without_backtrace();
  }
  WORKER_CHECK(spent.find("zero_grad") != std::string::npos, "spent gradients: got '{}'", spent);
  // add_param_group: refused on the ZeroOptimizer itself; one added through torch's Optimizer& (not virtual)
  // makes the next step raise, naming it, on every rank alike.
  m = value_error_of([&] { opt.add_param_group(torch::optim::OptimizerParamGroup({at::zeros({2}).requires_grad_(true)})); });
  WORKER_CHECK(m.find("add_param_group is not supported") != std::string::npos, "add_param_group: got '{}'", m);
  static_cast<torch::optim::Optimizer&>(opt).add_param_group(
      torch::optim::OptimizerParamGroup({at::zeros({2}).requires_grad_(true)}));
  opt.zero_grad();
  loss_of(params, at::ones({2, kIn}), at::zeros({2, kOut})).backward();
  m = value_error_of([&] { opt.step(); });
  WORKER_CHECK(m.find("it has 2 parameter groups") != std::string::npos, "a group added behind its back: got '{}'", m);
  // A model loaded (torch's Module::load set_s the loaded tensors into the parameters) between zero_grad() and the
  // backward, at stage 2 reduced in backward: the backward bypassed the buffers (it trained from wrong values);
  // refused at the step on every rank, nothing stepped; zero_grad() takes the loaded values in, and it trains.
  for (int stage : {1, 2}) {
    auto fresh = make_params();
    gpuops::optim::ZeroOptions hooks;
    hooks.stage = stage;
    hooks.reduce_in_backward = stage == 2;
    ZeroOptimizer loaded(fresh, comm, hooks, adamw_options());
    loaded.zero_grad();
    for (auto& p : fresh) p.set_data(p.detach().clone() + 0.5);  // what Module::load does
    loss_of(fresh, at::ones({2, kIn}), at::zeros({2, kOut})).backward();
    m = value_error_of([&] { loaded.step(); });
    WORKER_CHECK(m.find("were replaced after zero_grad()") != std::string::npos, "stage {} load: got '{}'", stage, m);
    const at::Tensor values = fresh[0].detach().clone();
    loaded.zero_grad();
    WORKER_CHECK(at::equal(fresh[0], values), "stage {}: zero_grad lost the loaded values", stage);
    loss_of(fresh, at::ones({2, kIn}), at::zeros({2, kOut})).backward();
    loaded.step();
    WORKER_CHECK(!at::equal(fresh[0], values), "stage {}: the step after the load did not move", stage);
  }
  comm.barrier().wait();
}

// torch's rule for parameters without a gradient, at stages 1 and 2 (at the step and reduced in backward):
// params[0] is used by every rank at every step; params[1] by rank 0 only, on even steps (on odd steps by no
// rank); params[2] never (an expert no token is routed to); params[3] is frozen (requires_grad false) after
// kFreeze steps, as a user does after building the optimizer. The reference is our unsharded AdamW stepping
// what torch would: the mean of the ranks' gradients with absent ones as zeros, no gradient where no rank has
// one. Elementwise losses, so the gradients are the same bits in both.
constexpr int kRuleSteps = 9, kFreeze = 4;

bool uses_second(int step, int rank) { return rank == 0 && step % 2 == 0; }

at::Tensor rule_loss(const std::vector<at::Tensor>& p, int step, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7000 + 10 * step + rank);
  at::Tensor loss = (p[0] * at::randn(p[0].sizes(), gen)).sum();
  if (uses_second(step, rank)) loss = loss + (p[1] * p[1] * at::randn(p[1].sizes(), gen)).sum();
  return loss + (p[3].square() * at::randn(p[3].sizes(), gen)).sum();  // frozen: no gradient after kFreeze
}

void scenario_without_grad(Communicator& comm) {
  const int n = comm.size(), rank = comm.rank();
  for (const auto& [stage, hooks] : {std::pair{1, false}, std::pair{2, false}, std::pair{1, true}, std::pair{2, true}}) {
    auto params = make_params();
    const std::vector<at::Tensor> initial = {params[2].detach().clone()};
    gpuops::optim::ZeroOptions zero;
    zero.stage = stage;
    zero.reduce_in_backward = hooks;
    if (hooks) zero.bucket_bytes = 512;
    ZeroOptimizer opt(params, comm, zero, adamw_options());
    auto ref = make_params();
    AdamW ref_opt(ref, adamw_options());
    at::Tensor frozen_at;
    for (int step = 0; step < kRuleSteps; ++step) {
      if (step == kFreeze) {
        params[3].requires_grad_(false);
        ref[3].requires_grad_(false);
        frozen_at = params[3].detach().clone();
      }
      opt.zero_grad();
      rule_loss(params, step, rank).backward();
      opt.step();
      // The reference: every rank's gradients, mean with absent ones as zeros, none where no rank has one.
      ref_opt.zero_grad();
      std::vector<at::Tensor> mean(ref.size());
      for (int r = 0; r < n; ++r) {
        std::vector<at::Tensor> inputs;
        for (const auto& p : ref)
          if (p.requires_grad()) inputs.push_back(p);
        const auto grads = torch::autograd::grad({rule_loss(ref, step, r)}, inputs, {}, false, false, true);
        size_t next = 0;
        for (size_t i = 0; i < ref.size(); ++i) {
          if (!ref[i].requires_grad()) continue;
          const at::Tensor& g = grads[next++];
          if (g.defined()) mean[i] = mean[i].defined() ? mean[i] + g : g.clone();
        }
      }
      for (size_t i = 0; i < ref.size(); ++i)
        if (mean[i].defined()) ref[i].mutable_grad() = mean[i] / n;
      ref_opt.step();
    }
    const std::string what = fmt::format("stage {}{}", stage, hooks ? " reduced in backward" : "");
    WORKER_CHECK(at::equal(params[2], initial[0]), "{}: a parameter no rank ever used moved", what);
    WORKER_CHECK(at::equal(params[3], frozen_at), "{}: a frozen parameter moved", what);
    for (size_t i = 0; i < params.size(); ++i) {
      const double err = (params[i] - ref[i]).abs().max().item<double>();
      WORKER_CHECK(err <= 1e-6 * ref[i].abs().max().item<double>(), "{}: params[{}] is {} from the reference", what, i, err);
    }
    // Each parameter's own step counter, as torch's state: none for the parameter never stepped.
    const auto state = opt.consolidate_state(0);
    if (rank == 0) {
      for (size_t i = 0; i < params.size(); ++i) {
        const auto* ref_state = static_cast<const gpuops::optim::AdamWParamState*>(
            ref_opt.state().count(ref[i].unsafeGetTensorImpl()) ? ref_opt.state().at(ref[i].unsafeGetTensorImpl()).get() : nullptr);
        WORKER_CHECK(state[i].empty() == (ref_state == nullptr), "{}: params[{}] has state {} here, {} in the reference",
                     what, i, !state[i].empty(), ref_state != nullptr);
        if (ref_state == nullptr) continue;
        const double steps = state[i].at("step").item<double>(), ref_steps = ref_state->step().item<double>();
        WORKER_CHECK(steps == ref_steps, "{}: params[{}] took {} steps, the reference {}", what, i, steps, ref_steps);
      }
    }
  }
}

// 8-bit moments (issue 32) and offload (issue 33) through the C++ API, stage 2, at the step and in the backward:
// offloaded training gives the bits of training not offloaded, 32- and 8-bit; the weights of 4096 elements or
// more keep 8-bit moments in the consolidated state; the offloaded step's timeline puts each bucket's gradient
// copy before its step and its parameter copy after.
void scenario_offload_8bit(Communicator& comm) {
  const int rank = comm.rank();
  const auto big_params = [] {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(77);
    std::vector<at::Tensor> p = {at::randn({96, 64}, gen) * 0.1, at::randn({96}, gen) * 0.1,
                                 at::randn({48, 96}, gen) * 0.1, at::randn({48}, gen) * 0.1};
    for (auto& t : p) t.requires_grad_(true);
    return p;
  };
  const auto loss = [](const std::vector<at::Tensor>& p, const at::Tensor& x) {
    return at::addmm(p[3], at::tanh(at::addmm(p[1], x, p[0].t())), p[2].t()).square().mean();
  };
  for (const bool hooks : {false, true}) {
    for (const int64_t bits : {int64_t{32}, int64_t{8}}) {
      std::vector<at::Tensor> runs[2];
      for (const bool offload : {false, true}) {
        auto params = big_params();
        gpuops::optim::ZeroOptions zero;
        zero.stage = 2;
        zero.reduce_in_backward = hooks;
        zero.bucket_bytes = 8192;  // several buckets
        if (offload) zero.offload = gpuops::optim::ZeroOptions::Offload::Cpu;
        ZeroOptimizer opt(params, comm, zero, AdamWOptions(1e-2).weight_decay(0.05).state_bits(bits));
        for (int step = 0; step < 6; ++step) {
          opt.zero_grad();
          for (int micro = 0; micro < 2; ++micro) {
            auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + 10 * step + micro + 1000 * rank);
            loss(params, at::randn({8, 64}, gen)).backward();
          }
          opt.step();
        }
        const std::string what = fmt::format("{}-bit, {}, {}", bits, hooks ? "reduced in the backward" : "at the step",
                                             offload ? "offloaded" : "not offloaded");
        if (offload) {
          const auto& timeline = opt.shards().offload_timeline();
          WORKER_CHECK(!timeline.empty(), "{}: no timeline", what);
          for (size_t k = 0; k < opt.bucket_count(); ++k) {
            double copied = -1, stepped_from = -1, stepped_to = -1, sent = -1;
            for (const auto& e : timeline) {
              if (e.bucket != k) continue;
              if (e.what == "gradient to host" || e.what == "gradient added on host") copied = std::max(copied, e.end_s);
              if (e.what == "step") stepped_from = e.begin_s, stepped_to = e.end_s;
              if (e.what == "parameters to device") sent = e.begin_s;
            }
            WORKER_CHECK(copied >= 0 && copied <= stepped_from && stepped_to <= sent,
                         "{}: bucket {} copied {} stepped {}..{} sent {}", what, k, copied, stepped_from, stepped_to, sent);
          }
        }
        const auto state = opt.consolidate_state(0);
        if (rank == 0) {
          WORKER_CHECK((state[0].count("exp_avg_codes") == 1) == (bits == 8) && state[1].count("exp_avg") == 1,
                       "{}: the weights' and biases' moments are not in the expected form", what);
        }
        for (const auto& p : params) runs[offload].push_back(p.detach().clone());
      }
      for (size_t i = 0; i < runs[0].size(); ++i)
        WORKER_CHECK(at::equal(runs[0][i], runs[1][i]), "{}-bit, {}: params[{}] differ offloaded", bits,
                     hooks ? "reduced in the backward" : "at the step", i);
    }
  }
}

int run_worker(const std::string& scenario) {
  return run_scenario(scenario, {{"train", scenario_train}, {"bad_input", scenario_bad_input},
                                 {"without_grad", scenario_without_grad}, {"offload_8bit", scenario_offload_8bit}});
}

// ------------------------------------------------------------------------------------------------------
// Parent side

void run_train(int n, int stage, int accumulation, bool hooks = false, bool overlap = false) {
  ::setenv("GPUOPS_ZERO_HOOKS", hooks ? "1" : "0", 1);
  ::setenv("GPUOPS_ZERO_OVERLAP", overlap ? "1" : "0", 1);
  ::setenv("GPUOPS_ZERO_STAGE", std::to_string(stage).c_str(), 1);
  ::setenv("GPUOPS_ZERO_ACCUM", std::to_string(accumulation).c_str(), 1);
  const auto t0 = Clock::now();
  auto ranks = spawn(n, "train", 30000);
  const bool in_time = wait_ranks(ranks, t0 + std::chrono::seconds(55));
  EXPECT_TRUE(in_time) << "ranks still running after 55 s\n" << ranks.logs();
  for (int r = 0; r < n; ++r) EXPECT_EQ(ranks.status[r], 0) << "rank " << r << "\n" << ranks.logs();
  std::printf("[ stage %d%s%s, %d ranks, accumulation %d: %.2f s; rank 0: %s ]\n", stage,
              hooks ? " reduced in backward" : "", overlap ? ", gathers overlapped" : "", n, accumulation,
              std::chrono::duration<double>(Clock::now() - t0).count(),
              read_file(ranks.dir + "/result.0").c_str());
}

TEST(ZeroOptimizer, Stage1TwoRanks) { run_train(2, 1, 2); }
TEST(ZeroOptimizer, Stage2TwoRanks) { run_train(2, 2, 2); }
TEST(ZeroOptimizer, Stage1FourRanks) { run_train(4, 1, 2); }
TEST(ZeroOptimizer, Stage2FourRanksNoAccumulation) { run_train(4, 2, 1); }
TEST(ZeroOptimizer, Stage1ReducedInBackwardTwoRanks) { run_train(2, 1, 2, true); }
TEST(ZeroOptimizer, Stage2ReducedInBackwardTwoRanks) { run_train(2, 2, 2, true); }
TEST(ZeroOptimizer, Stage2ReducedInBackwardFourRanksNoAccumulation) { run_train(4, 2, 1, true); }
TEST(ZeroOptimizer, Stage2ReducedInBackwardGathersOverlappedTwoRanks) { run_train(2, 2, 2, true, true); }
TEST(ZeroOptimizer, Stage1GathersOverlappedTwoRanks) { run_train(2, 1, 2, false, true); }
TEST(ZeroOptimizer, BadInputTwoRanks) { run_all_ok(2, "bad_input"); }
TEST(ZeroOptimizer, ParametersWithoutGradientsAreNotSteppedTwoRanks) { run_all_ok(2, "without_grad"); }
TEST(ZeroOptimizer, OffloadAnd8BitMomentsTwoRanks) { run_all_ok(2, "offload_8bit"); }

// The estimator (torch-free) counts the fp32 chunks of a 16-bit reduction with its own copy of the chunk size.
TEST(ZeroOptimizer, EstimatorKnowsTheReduceChunk) {
  EXPECT_EQ(gpuops::estimator::kZeroReduceChunk, gpuops::optim::ZeroShards::kReduceChunk);
}

}  // namespace

int main(int argc, char** argv) {
  if (const char* scenario = std::getenv("GPUOPS_COMM_WORKER")) return run_worker(scenario);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
