// ZeroOptimizer beyond fp32 AdamW, with real processes over Gloo (multiprocess.h): Adam and SGD against their
// single-process twins; bfloat16 parameters whose fp32 masters follow single-process training (gradients
// reduced in fp32); checkpoints through TrainingState, resharded 2 -> 4 -> 1 -> 2 and compared bit for bit;
// a SIGTERM on one rank makes every rank save and stop at the same step.
#include <gtest/gtest.h>

#include <csignal>
#include <iterator>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/serialize.h>

#include "gpuops/communicator.h"
#include "gpuops/grad_scaler.h"
#include "gpuops/memory_budget.h"
#include "gpuops/optimizers.h"
#include "gpuops/training_state.h"
#include "gpuops/zero_optimizer.h"
#include "multiprocess.h"
#include "parity_bound.h"

namespace {

using gpuops::dist::Communicator;
using gpuops::dist::CommunicatorOptions;
using namespace gpuops::optim;  // NOLINT
using namespace gpuops_test;    // NOLINT: the launch helpers

constexpr int64_t kBatch = 4, kIn = 11, kHidden = 23, kOut = 3;  // odd sizes: padding between parameters

// An MLP whose last layer is `last_dtype` (a second flat buffer when it is not float32).
std::vector<at::Tensor> make_params(at::ScalarType dtype = at::kFloat, at::ScalarType last_dtype = at::kFloat) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(77);
  std::vector<at::Tensor> p = {(at::randn({kHidden, kIn}, gen) * 0.3).to(dtype), (at::randn({kHidden}, gen) * 0.1).to(dtype),
                               (at::randn({kOut, kHidden}, gen) * 0.3).to(last_dtype),
                               (at::randn({kOut}, gen) * 0.1).to(last_dtype)};
  for (auto& t : p) t.requires_grad_(true);
  return p;
}

std::pair<at::Tensor, at::Tensor> batch_of(int step, int micro, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5000 + 1000 * step + 10 * micro + rank);
  return {at::randn({kBatch, kIn}, gen), at::randn({kBatch, kOut}, gen)};
}

at::Tensor loss_of(const std::vector<at::Tensor>& p, const at::Tensor& x, const at::Tensor& y) {
  at::Tensor h = at::tanh(at::addmm(p[1], x.to(p[0].scalar_type()), p[0].t()));
  return (at::addmm(p[3], h.to(p[2].scalar_type()), p[2].t()).to(at::kFloat) - y).square().mean();
}

constexpr int kAccumulation = 2;

// One step of rank `rank` (or of the concatenated batch of all `ranks` when rank < 0): micro-batches summed
// into the gradients (divided by the window), then the optimizer's step.
// `per_rank` (rank < 0): the mean of each rank's loss, each through its own matmuls, rather than the loss of the
// concatenated batch: another equally valid order of the float32 sums.
void train_step(torch::optim::Optimizer& opt, const std::vector<at::Tensor>& params, int step, int rank, int ranks,
                bool per_rank = false) {
  for (int m = 0; m < kAccumulation; ++m) {
    std::vector<at::Tensor> xs, ys;
    for (int r = rank < 0 ? 0 : rank; r < (rank < 0 ? ranks : rank + 1); ++r) {
      auto [x, y] = batch_of(step, m, r);
      xs.push_back(x);
      ys.push_back(y);
    }
    at::Tensor loss = loss_of(params, at::cat(xs), at::cat(ys));
    if (per_rank) {
      loss = loss_of(params, xs[0], ys[0]);
      for (size_t r = 1; r < xs.size(); ++r) loss = loss + loss_of(params, xs[r], ys[r]);
      loss = loss / static_cast<double>(xs.size());
    }
    (loss / kAccumulation).backward();
  }
  opt.step();
}


// ------------------------------------------------------------------------------------------------------
// Adam and SGD: ZeRO stage 2 against the same optimizer on the concatenated batch, 20 steps.

// Within the distance between two equally valid float32 references (parity_bound.h): the concatenated batch's
// loss, and the mean of the ranks' losses.
template <class Base, class Options>
double zero_against_single(Communicator& comm, const Options& options) {
  auto params = make_params(), ref = make_params(), other = make_params();
  ZeroOptimizer<Base> zero(params, comm, 2, options);
  Base single(ref, options), single_other(other, options);
  for (int step = 0; step < 20; ++step) {
    zero.zero_grad();
    single.zero_grad();
    single_other.zero_grad();
    train_step(zero, params, step, comm.rank(), comm.size());
    train_step(single, ref, step, -1, comm.size());
    train_step(single_other, other, step, -1, comm.size(), /*per_rank=*/true);
  }
  const Parity p = parity(params, ref, other);
  WORKER_CHECK(p.holds(), "{}: max relative error {} against single-process > {} (the two references: {})",
               zero.kind(), p.worst, p.bound(), p.noise);
  WORKER_CHECK(max_rel_error(params[0], make_params()[0]) > 0.01, "{}: training barely moved", zero.kind());
  return p.worst;
}

void scenario_kinds(Communicator& comm) {
  const double adam = zero_against_single<Adam>(comm, AdamOptions(2e-2).weight_decay(0.1).amsgrad(true));
  const double sgd = zero_against_single<SGD>(comm, SGDOptions(5e-2).momentum(0.9).nesterov(true).weight_decay(1e-3));
  write_file(fmt::format("{}/result.{}", env_or("GPUOPS_COMM_DIR", "/tmp"), comm.rank()),
             fmt::format("Adam (amsgrad, L2) max_rel_err={:.3g}; SGD (nesterov) max_rel_err={:.3g}", adam, sgd));
}

// ------------------------------------------------------------------------------------------------------
// 16-bit parameters (bf16, fp16; GPUOPS_ZERO_DTYPE): ZeRO's fp32 masters against a single process that
// computes every rank's 16-bit gradient (accumulated in 16 bits as autograd does), averages them in fp32 and
// steps fp32 masters; 50 steps with a GradScaler (the scale grows) and clipping on both sides.
//
// Step by step, not trajectory against trajectory: before each step the reference takes ZeRO's state (masters,
// moments, step counts and the 16-bit parameters, consolidated on rank 0), so each comparison is one step from
// the same state. Over 50 steps the trajectories themselves are not comparable at a fixed bound on every CPU: a
// clip coefficient or a mean one fp32 ulp apart (the sum over ranks runs in Gloo's order, the norm in shards)
// moves a master by an ulp, which now and then flips its 16-bit rounding, and a 16-bit network then drifts
// apart chaotically, at a step that depends on the CPU's matmul blocking. One step from the same state differs
// only by that reordering: the mean gradient and the clip coefficient by a few fp32 ulps, which Adam's
// normalisation carries into an update of lr = 1e-2 per element: about 1e-8 of the masters' magnitude, measured
// 4.3e-8 to 8.0e-8 (2 and 4 ranks). The bound, 1e-6, is 12 times the largest; a wrong step (a missing
// gradient, a wrong scale or clip) moves a master by a step's size, 0.11-0.17 here.

// The reference AdamW's state for `master` from ZeRO's consolidated entry (none before the first step).
void take_state(AdamW& single, const at::Tensor& master, const NamedTensors& zero_state) {
  at::NoGradGuard no_grad;
  master.copy_(zero_state.at("master_param"));
  auto& states = single.state();
  states.erase(master.unsafeGetTensorImpl());
  if (!zero_state.count("exp_avg")) return;
  auto st = std::make_unique<AdamWParamState>();
  st->step(zero_state.at("step").clone());
  st->exp_avg(zero_state.at("exp_avg").clone());
  st->exp_avg_sq(zero_state.at("exp_avg_sq").clone());
  states[master.unsafeGetTensorImpl()] = std::move(st);
}

void scenario_bf16(Communicator& comm) {
  const int n = comm.size(), stage = std::stoi(env_or("GPUOPS_ZERO_STAGE", "1"));
  const at::ScalarType dtype = env_or("GPUOPS_ZERO_DTYPE", "bf16") == "fp16" ? at::kHalf : at::kBFloat16;
  auto params = make_params(dtype, dtype);
  ZeroOptimizer zero(params, comm, stage, AdamWOptions(1e-2));
  auto ref = make_params(dtype, dtype);
  gpuops::amp::GradScalerOptions so;
  so.init_scale = 256.0;
  so.growth_interval = 9;
  gpuops::amp::GradScaler zscaler(so), rscaler(so);
  constexpr double kMaxNorm = 1.0;  // clips on about half the steps
  constexpr double kStepBound = 1e-6;
  int clipped = 0;
  std::vector<at::Tensor> masters;
  for (const auto& p : ref) masters.push_back(p.detach().to(at::kFloat).requires_grad_(true));
  AdamW single(masters, AdamWOptions(1e-2));
  const int64_t total = zero.bucket(0).data.numel();
  double worst = 0, moved = 0;
  for (int step = 0; step < 50; ++step) {
    // The reference starts this step where ZeRO stands (rank 0; the others take part in the collective).
    const auto before = zero.consolidate_state(0);
    if (comm.rank() == 0) {
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < ref.size(); ++i) {
        take_state(single, masters[i], before[i]);
        ref[i].copy_(params[i]);
      }
    }
    zero.zero_grad();
    comm.reset_traffic();
    for (int m = 0; m < kAccumulation; ++m) {
      auto [x, y] = batch_of(step, m, comm.rank());
      zscaler.scale(loss_of(params, x, y) / kAccumulation).backward();
    }
    clipped += zscaler.clip_grad_norm_(zero, kMaxNorm).item<double>() > kMaxNorm ? 1 : 0;
    zscaler.step(zero);
    zscaler.update();
    // One step's traffic (ring algorithm): the gradients reduce-scattered in fp32, the 16-bit parameters
    // all-gathered, which parameters have a gradient (an all-reduce), the overflow flag and the squared norm
    // (two all-gathers of two float64 per rank: ZeroShards::combine).
    const auto t = comm.traffic();
    WORKER_CHECK(t.reduce_scatter.ring_sent_bytes == 4 * total * (n - 1) / n &&
                     t.all_gather.ring_sent_bytes == 2 * total * (n - 1) / n + 2 * 16 * (n - 1) &&
                     t.all_reduce.calls == 1,
                 "step traffic: reduce-scatter {} B, all-gather {} B, {} all-reduces, for {} 16-bit elements",
                 t.reduce_scatter.ring_sent_bytes, t.all_gather.ring_sent_bytes, t.all_reduce.calls, total);
    const auto after = zero.consolidate_state(0);
    if (comm.rank() != 0) continue;
    single.zero_grad();
    std::vector<at::Tensor> sum(ref.size());
    for (int r = 0; r < n; ++r) {
      for (auto& p : ref) p.mutable_grad() = at::zeros_like(p);  // accumulate in bf16 from zero, as the flat buffer
      for (int m = 0; m < kAccumulation; ++m) {
        auto [x, y] = batch_of(step, m, r);
        rscaler.scale(loss_of(ref, x, y) / kAccumulation).backward();
      }
      for (size_t i = 0; i < ref.size(); ++i) sum[i] = r == 0 ? ref[i].grad().to(at::kFloat) : sum[i] + ref[i].grad().to(at::kFloat);
    }
    for (size_t i = 0; i < ref.size(); ++i) masters[i].mutable_grad() = sum[i] / n;
    rscaler.clip_grad_norm_(single, kMaxNorm);
    rscaler.step(single);
    rscaler.update();
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor master = after[i].at("master_param");
      const double err = max_rel_error(master, masters[i]);
      worst = std::max(worst, err);
      moved = std::max(moved, max_rel_error(master, before[i].at("master_param")));
      WORKER_CHECK(err <= kStepBound, "step {}: params[{}]'s master is {} (relative) from the reference's step "
                   "from the same state > {}", step, i, err, kStepBound);
      WORKER_CHECK(at::equal(master.to(dtype), params[i].detach()), "step {}: params[{}] is not its master rounded",
                   step, i);
    }
  }
  int64_t numel = 0;
  for (const auto& p : params) numel += p.numel();
  WORKER_CHECK(zero.shards().master_bytes() * n >= 4 * numel && zero.shards().master_bytes() * n < 4 * (numel + 64),
               "fp32 masters: {} bytes per rank for {} parameters", zero.shards().master_bytes(), numel);
  const auto full = zero.consolidate_state(0);
  if (comm.rank() != 0) return;
  WORKER_CHECK(moved > 100 * kStepBound, "a step moved the masters by at most {}: the bound would prove little",
               moved);
  WORKER_CHECK(zscaler.get_scale() == rscaler.get_scale() && zscaler.get_scale() > 256.0 && clipped > 0 &&
                   clipped < 50,
               "scale {} (reference {}), clipped on {} steps", zscaler.get_scale(), rscaler.get_scale(), clipped);
  // The masters carry what bf16 cannot hold (else the test could not tell fp32 masters from none).
  const at::Tensor m0 = full[0].at("master_param");
  WORKER_CHECK(!at::equal(m0, m0.to(dtype).to(at::kFloat)), "the fp32 masters hold only 16-bit values");
  write_file(fmt::format("{}/result.0", env_or("GPUOPS_COMM_DIR", "/tmp")),
             fmt::format("{} stage {}: fp32 masters max_rel_err={:.3g} per step against single-process fp32 "
                         "reduction from the same state (largest step {:.3g}); 50 steps, final scale {}, clipped on "
                         "{} steps", c10::toString(dtype), stage, worst, moved, zscaler.get_scale(), clipped));
}

// ------------------------------------------------------------------------------------------------------
// Checkpoints: one phase per launch, sharing GPUOPS_ZERO_CKPT. An fp32 buffer and a bf16 one.

gpuops::TrainingObjects objects_of(torch::optim::Optimizer& opt) {
  gpuops::TrainingObjects o;
  o.optimizer = &opt;
  return o;
}

void save_tensors(const std::vector<at::Tensor>& ts, const std::string& path) { torch::save(ts, path); }
std::vector<at::Tensor> load_tensors(const std::string& path) {
  std::vector<at::Tensor> ts;
  torch::load(ts, path);
  return ts;
}

// The consolidated state as one list of tensors (fixed order), to compare bit for bit across phases.
std::vector<at::Tensor> flatten(const std::vector<NamedTensors>& full) {
  std::vector<at::Tensor> out;
  for (const auto& state : full)
    for (const auto& [name, t] : state) out.push_back(t);
  return out;
}

void check_same(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, const std::string& what) {
  WORKER_CHECK(a.size() == b.size(), "{}: {} tensors against {}", what, a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) WORKER_CHECK(at::equal(a[i], b[i]), "{}: tensor {} differs", what, i);
}

void scenario_phase(Communicator& comm) {
  const std::string dir = env_or("GPUOPS_ZERO_CKPT", "/tmp/zero-ckpt"), phase = env_or("GPUOPS_ZERO_PHASE", "");
  auto params = make_params(at::kFloat, at::kBFloat16);
  gpuops::TrainingStateOptions so;
  so.process_group = comm.process_group()->getBackend(c10::DeviceType::CPU);
  if (phase != "first") {  // the parameters at step 5, as the first phase saved them
    at::NoGradGuard no_grad;
    const auto saved = load_tensors(dir + "/params5.pt");
    for (size_t i = 0; i < params.size(); ++i) params[i].copy_(saved[i]);
  }
  ZeroOptions zero;
  zero.stage = 2;
  zero.param_names = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};
  ZeroOptimizer opt(params, comm, zero, AdamWOptions(1e-2).weight_decay(0.05));
  const auto train = [&](int from, int to) {
    for (int step = from; step < to; ++step) {
      opt.zero_grad();
      train_step(opt, params, step, comm.rank(), comm.size());
    }
  };
  const auto consolidated = [&] { return flatten(opt.consolidate_state(0)); };
  if (phase == "first") {  // 2 ranks: 5 steps, save, the reference state; then 5 more, the reference parameters
    train(0, 5);
    gpuops::TrainingState state(dir + "/a", so);
    gpuops::TrainingProgress progress;
    progress.step = 5;
    const std::string path = state.save(progress, objects_of(opt));
    WORKER_CHECK(!path.empty() && read_file(path + "/rank-00001.pt").size() > 0, "no shard file of rank 1 in '{}'", path);
    const auto full = consolidated();
    if (comm.rank() == 0) {
      save_tensors(full, dir + "/full5.pt");
      std::vector<at::Tensor> p5;
      for (const auto& p : params) p5.push_back(p.detach().clone());
      save_tensors(p5, dir + "/params5.pt");
    }
    train(5, 10);
    if (comm.rank() == 0) {
      std::vector<at::Tensor> p10;
      for (const auto& p : params) p10.push_back(p.detach().clone());
      save_tensors(p10, dir + "/params10.pt");
    }
    return;
  }
  // A later phase: load the previous phase's state, resharded; the consolidated state is the first one's.
  const std::string from = dir + (phase == "second" ? "/a" : phase == "third" ? "/b" : "/c");
  gpuops::TrainingState state(from, so);
  if (phase == "second") {  // another world size, not allowed: refused, nothing changed
    std::string error;
    try {
      state.load(objects_of(opt), true, /*allow_reshard=*/false);
    } catch (const c10::ValueError& e) {
      error = e.what_without_backtrace();
    }
    WORKER_CHECK(error.find("allow_reshard") != std::string::npos && error.find("saved by 2 ranks") != std::string::npos,
                 "load at another world size without allow_reshard: got '{}'", error);
    WORKER_CHECK(opt.state_bytes() == opt.shards().master_bytes(), "a refused load left optimizer state behind");
    // Another model (a parameter renamed, same shapes): refused, naming both.
    auto others = make_params(at::kFloat, at::kBFloat16);
    ZeroOptions renamed = zero;
    renamed.param_names[1] = "fc1.b";
    ZeroOptimizer other(others, comm, renamed, AdamWOptions(1e-2));
    error.clear();
    try {
      state.load(objects_of(other), true, /*allow_reshard=*/true);
    } catch (const c10::ValueError& e) {
      error = e.what_without_backtrace();
    }
    WORKER_CHECK(error.find("it has 'fc1.bias' where this optimizer has 'fc1.b' (params[1], shape [23])") !=
                     std::string::npos, "a renamed parameter: got '{}'", error);
  }
  const auto loaded = state.load(objects_of(opt), true, /*allow_reshard=*/true);
  WORKER_CHECK(loaded && loaded->step == 5, "loaded step {}", loaded ? loaded->step : -1);
  const auto full = consolidated();
  if (comm.rank() == 0) check_same(full, load_tensors(dir + "/full5.pt"), "consolidated state after " + phase);
  if (phase != "fourth") {
    gpuops::TrainingState next(dir + (phase == "second" ? "/b" : "/c"), so);
    gpuops::TrainingProgress progress;
    progress.step = 5;
    next.save(progress, objects_of(opt));
    return;
  }
  train(5, 10);  // back at 2 ranks: the same bits as the first phase's uninterrupted run
  if (comm.rank() == 0) {
    std::vector<at::Tensor> p10;
    for (const auto& p : params) p10.push_back(p.detach().clone());
    check_same(p10, load_tensors(dir + "/params10.pt"), "parameters after resuming through 4 and 1 ranks");
  }
}

// ------------------------------------------------------------------------------------------------------
// SIGTERM on rank 1 at step 3: every rank sees should_stop() at the same step, saves, and stops.

void scenario_sigterm(Communicator& comm) {
  const std::string dir = env_or("GPUOPS_COMM_DIR", "/tmp") + "/state";
  auto params = make_params();
  ZeroOptimizer opt(params, comm, 1, AdamWOptions(1e-2));
  gpuops::TrainingStateOptions so;
  so.process_group = comm.process_group()->getBackend(c10::DeviceType::CPU);
  gpuops::TrainingState state(dir, so);
  for (int step = 0; step < 100; ++step) {
    opt.zero_grad();
    train_step(opt, params, step, comm.rank(), comm.size());
    if (step == 3 && comm.rank() == 1) std::raise(SIGTERM);  // a scheduler's signal, caught by TrainingState
    if (state.should_stop()) {
      gpuops::TrainingProgress progress;
      progress.step = step + 1;
      const std::string path = state.save(progress, objects_of(opt));
      write_file(fmt::format("{}/result.{}", env_or("GPUOPS_COMM_DIR", "/tmp"), comm.rank()),
                 fmt::format("stopped after step {} with {}", step + 1, path));
      return;
    }
  }
  throw std::runtime_error("never stopped");
}

// ------------------------------------------------------------------------------------------------------
// Stage 2 reducing in backward: right after backward only the gradient shards exist, the peak of the
// backward is lower than when the whole flat gradient waits for the step, and the parameters agree.

// A deep MLP (8 layers of 64): many buckets, so that only a few are in flight at any time.
std::vector<at::Tensor> deep_params() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(99);
  std::vector<at::Tensor> p;
  for (int l = 0; l < 8; ++l) {
    p.push_back((at::randn({64, 64}, gen) * 0.15).requires_grad_(true));
    p.push_back((at::randn({64}, gen) * 0.1).requires_grad_(true));
  }
  return p;
}

at::Tensor deep_loss(const std::vector<at::Tensor>& p, const at::Tensor& x) {
  at::Tensor h = x;
  for (size_t l = 0; l < p.size(); l += 2) h = at::tanh(at::addmm(p[l + 1], h, p[l].t()));
  return h.square().mean();
}

void scenario_hooks_memory(Communicator& comm) {
  const auto run = [&](bool hooks, int64_t* peak, int64_t* after_backward) {
    auto params = deep_params();
    ZeroOptions zero;
    zero.stage = 2;
    zero.reduce_in_backward = hooks;
    zero.bucket_bytes = 4096;
    ZeroOptimizer opt(params, comm, zero, AdamWOptions(1e-2));
    for (int step = 0; step < 5; ++step) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(300 + 10 * step + comm.rank());
      const at::Tensor x = at::randn({8, 64}, gen);
      gpuops::MemoryBudget budget;  // from zero_grad() (which allocates the flat gradient at the step) on
      opt.zero_grad();
      deep_loss(params, x).backward();
      *peak = budget.peak_bytes();
      *after_backward = opt.gradient_bytes();
      if (hooks)
        for (const auto& p : params) WORKER_CHECK(!p.grad().defined(), "a full gradient survived the backward");
      opt.step();
    }
    std::vector<at::Tensor> out;
    for (const auto& p : params) out.push_back(p.detach().clone());
    return out;
  };
  int64_t peak_hooks = 0, peak_step = 0, grads_hooks = 0, grads_step = 0;
  const auto a = run(true, &peak_hooks, &grads_hooks);
  const auto b = run(false, &peak_step, &grads_step);
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, max_rel_error(a[i], b[i]));
  WORKER_CHECK(worst <= 1e-6, "reduced in backward against at the step: max relative error {}", worst);
  WORKER_CHECK(grads_hooks * comm.size() < grads_step, "gradient bytes after backward: {} in backward, {} at the step",
               grads_hooks, grads_step);
  WORKER_CHECK(peak_hooks < peak_step, "backward peak {} reducing in backward, {} at the step", peak_hooks, peak_step);
  write_file(fmt::format("{}/result.{}", env_or("GPUOPS_COMM_DIR", "/tmp"), comm.rank()),
             fmt::format("stage 2: after backward {} gradient bytes (reduced in backward) against {} (at the step); "
                         "backward peak {} against {} bytes; max_rel_err {:.3g}",
                         grads_hooks, grads_step, peak_hooks, peak_step, worst));
}

// ------------------------------------------------------------------------------------------------------
// The last rank SIGKILLs itself after its backward of step 3: the others, inside the step's reduce-scatter,
// raise the communicator's clear error (the collective, this rank, the lost peer) within the timeout.

void scenario_killed_mid_step(Communicator& comm) {
  auto params = make_params();
  ZeroOptimizer opt(params, comm, 2, AdamWOptions(1e-2));
  for (int step = 0; step < 10; ++step) {
    opt.zero_grad();
    auto [x, y] = batch_of(step, 0, comm.rank());
    loss_of(params, x, y).backward();
    if (step == 3 && comm.rank() == comm.size() - 1) std::raise(SIGKILL);
    const int64_t start = now_ms();
    try {
      opt.step();
    } catch (const c10::Error& e) {
      write_file(fmt::format("{}/result.{}", env_or("GPUOPS_COMM_DIR", "/tmp"), comm.rank()),
                 fmt::format("{} {}", now_ms() - start, e.what_without_backtrace()));
      return;
    }
  }
  throw std::runtime_error("every step completed without the killed peer");
}

int run_worker(const std::string& scenario) {
  return run_scenario(scenario, {{"kinds", scenario_kinds}, {"bf16", scenario_bf16}, {"phase", scenario_phase}, {"sigterm", scenario_sigterm},
                                 {"killed_mid_step", scenario_killed_mid_step},
                                 {"hooks_memory", scenario_hooks_memory}});
}

// ------------------------------------------------------------------------------------------------------
// Parent side

Ranks run(int n, const std::string& scenario) {
  const auto t0 = Clock::now();
  auto ranks = spawn(n, scenario, 30000);
  const bool in_time = wait_ranks(ranks, t0 + std::chrono::seconds(60));
  EXPECT_TRUE(in_time) << "ranks still running after 60 s\n" << ranks.logs();
  for (int r = 0; r < n; ++r) EXPECT_EQ(ranks.status[r], 0) << "rank " << r << "\n" << ranks.logs();
  std::printf("[ %s, %d ranks: %.2f s; rank 0: %s ]\n", scenario.c_str(), n,
              std::chrono::duration<double>(Clock::now() - t0).count(), read_file(ranks.dir + "/result.0").c_str());
  return ranks;
}

TEST(ZeroKinds, AdamAndSgdTwoRanks) { run(2, "kinds"); }

// The 16-bit scenario ("bf16", which also runs fp16) for one parameter dtype, stage and world size.
void run_16_bit(const char* dtype, int stage, int n) {
  ::setenv("GPUOPS_ZERO_DTYPE", dtype, 1);
  ::setenv("GPUOPS_ZERO_STAGE", std::to_string(stage).c_str(), 1);
  run(n, "bf16");
}

TEST(ZeroBf16, Stage1TwoRanks) { run_16_bit("bf16", 1, 2); }
TEST(ZeroBf16, Stage2TwoRanks) { run_16_bit("bf16", 2, 2); }
TEST(ZeroBf16, Stage2FourRanks) { run_16_bit("bf16", 2, 4); }  // Gloo's sum runs in another order than the reference's
TEST(ZeroFp16, Stage2TwoRanks) { run_16_bit("fp16", 2, 2); }
TEST(ZeroFp16, Stage1FourRanks) { run_16_bit("fp16", 1, 4); }

TEST(ZeroReduceInBackward, Stage2HoldsOnlyShardsAfterBackward) { run(2, "hooks_memory"); }

TEST(ZeroCheckpoint, ReshardTwoFourOneTwo) {
  char tmpl[] = "/tmp/gpuops-zero-ckpt-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  ::setenv("GPUOPS_ZERO_CKPT", tmpl, 1);
  for (const auto& [phase, n] : std::vector<std::pair<std::string, int>>{{"first", 2}, {"second", 4}, {"third", 1},
                                                                           {"fourth", 2}}) {
    ::setenv("GPUOPS_ZERO_PHASE", phase.c_str(), 1);
    run(n, "phase");
    if (::testing::Test::HasFailure()) break;
  }
}

TEST(ZeroCheckpoint, SigtermOnOneRankStopsAll) {
  auto ranks = run(2, "sigterm");
  const std::string a = read_file(ranks.dir + "/result.0"), b = read_file(ranks.dir + "/result.1");
  EXPECT_NE(a.find("stopped after step 4"), std::string::npos) << a;
  EXPECT_EQ(a, b) << "the ranks stopped differently";
}

TEST(ZeroCheckpoint, ARankKilledMidStepMakesTheOthersRaiseWithinTheTimeout) {
  constexpr int kTimeoutMs = 4000, kMarginMs = 1500;
  const auto t0 = Clock::now();
  auto ranks = spawn(3, "killed_mid_step", kTimeoutMs);
  const bool in_time = wait_ranks(ranks, t0 + std::chrono::seconds(40), {0, 1});
  kill_rest(ranks);
  ASSERT_TRUE(in_time) << "a survivor hung\n" << ranks.logs();
  EXPECT_EQ(ranks.status[2], 128 + SIGKILL) << ranks.logs();
  for (int r : {0, 1}) {
    ASSERT_EQ(ranks.status[r], 0) << "rank " << r << "\n" << ranks.logs();
    std::istringstream result(read_file(fmt::format("{}/result.{}", ranks.dir, r)));
    int64_t elapsed = -1;
    result >> elapsed;
    const std::string message((std::istreambuf_iterator<char>(result)), std::istreambuf_iterator<char>());
    // The step's first collective: the agreement on which parameters have a gradient.
    EXPECT_NE(message.find("all_reduce(max)"), std::string::npos) << message;
    EXPECT_NE(message.find(fmt::format("rank {} of 3", r)), std::string::npos) << message;
    EXPECT_GE(elapsed, 0);
    EXPECT_LE(elapsed, kTimeoutMs + kMarginMs) << message;
    std::printf("[ rank %d raised after %lld ms: %s ]\n", r, static_cast<long long>(elapsed),
                message.substr(0, message.find('\n')).c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (const char* scenario = std::getenv("GPUOPS_COMM_WORKER")) return run_worker(scenario);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
