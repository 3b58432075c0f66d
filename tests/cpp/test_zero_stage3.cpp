// ZeRO stage 3 from C++ (gpuops::optim::ShardedSequential over a stage-3 ZeroOptimizer), over Gloo with real
// processes (multiprocess.h). Each rank trains an MLP Sequential (one layer checkpointed through a
// CheckpointedSequential inside it) for 20 steps with our GradScaler, clipping and 2 micro-batches, and also
// the single-process reference (our AdamW on every rank's gradient averaged, regenerated locally), twice to
// check the bits, then checks: within 10 times the distance between two equally valid references (floor: two
// float32 ulps), the ranks agree, the parameters are placeholders between steps.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/autograd.h>
#include <torch/serialize.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

#include "gpuops/agreement.h"
#include "gpuops/checkpointed_sequential.h"
#include "gpuops/communicator.h"
#include "gpuops/grad_scaler.h"
#include "gpuops/optimizers.h"
#include "gpuops/sharded_sequential.h"
#include "gpuops/training_state.h"
#include "gpuops/zero_optimizer.h"
#include "multiprocess.h"
#include "parity_bound.h"

namespace {

using gpuops::amp::GradScaler;
using gpuops::amp::GradScalerOptions;
using gpuops::dist::Communicator;
using gpuops::optim::AdamW;
using gpuops::optim::AdamWOptions;
using gpuops::optim::ShardedSequential;
using gpuops::optim::ZeroOptimizer;
using gpuops::optim::ZeroOptions;
using namespace gpuops_test;  // NOLINT: the launch helpers

constexpr int kSteps = 20, kMicro = 2;
constexpr int64_t kBatch = 6, kIn = 13, kHidden = 31, kOut = 5;  // odd sizes: padding within every unit

// `checkpointed`: the middle layer recomputed in backward (the reference, which takes grad(), is not).
torch::nn::Sequential make_net(bool checkpointed = true) {
  torch::manual_seed(1234);
  gpuops::CheckpointedSequential middle(torch::nn::Sequential(torch::nn::Linear(kHidden, kHidden), torch::nn::Tanh()));
  if (checkpointed) middle->checkpoint_every(1);
  return torch::nn::Sequential(torch::nn::Linear(kIn, kHidden), torch::nn::Tanh(), middle,
                               torch::nn::Linear(kHidden, kOut));
}

std::pair<at::Tensor, at::Tensor> batch_of(int step, int micro, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500000 + 1000 * step + 10 * micro + rank);
  return {at::randn({kBatch, kIn}, gen), at::randn({kBatch, kOut}, gen)};
}

GradScalerOptions scaler_options() {
  GradScalerOptions o;
  o.init_scale = 256.0;
  return o;
}

// The parameters in sequential_units' order, gathered on this rank (full_parameters to every rank in turn).
std::vector<at::Tensor> gathered(ZeroOptimizer<AdamW>& opt, int world) {
  std::vector<at::Tensor> mine;
  for (int r = 0; r < world; ++r) {
    auto full = opt.shards().full_parameters(r);
    if (!full.empty()) mine = std::move(full);
  }
  return mine;
}

std::vector<at::Tensor> train_sharded(Communicator& comm) {
  auto net = make_net();
  auto units = gpuops::optim::sequential_units(net);
  WORKER_CHECK(units.units.back() == 2, "{} units", units.units.back() + 1);
  ZeroOptions zero;
  zero.stage = 3;
  zero.units = units.units;
  zero.param_names = units.names;
  zero.reduce_in_backward = true;
  // 3 ranks: the units re-bound to buffers of an explicit device (the path of a CPU-built model on a GPU)
  if (comm.size() == 3) zero.device = c10::Device(c10::kCPU);
  ZeroOptimizer opt(units.params, comm, zero, AdamWOptions(1e-2));
  ShardedSequential model(net, opt);
  GradScaler scaler(scaler_options());
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    for (int m = 0; m < kMicro; ++m) {
      auto [x, y] = batch_of(step, m, comm.rank());
      scaler.scale((model->forward(x) - y).square().mean() / kMicro).backward();
    }
    scaler.clip_grad_norm_(opt, 1.0);
    scaler.step(opt);
    scaler.update();
    for (const auto& p : units.params) WORKER_CHECK(p.numel() == 0, "a parameter stayed gathered after step {}", step);
    WORKER_CHECK(opt.shards().gathered_bytes() == 0, "{} bytes stayed gathered", opt.shards().gathered_bytes());
  }
  return gathered(opt, comm.size());
}

// `reversed`: the ranks' gradients summed in the other order, an equally valid float32 reference.
std::vector<at::Tensor> train_reference(int world, bool reversed = false) {
  auto net = make_net(false);
  auto params = gpuops::optim::sequential_units(net).params;
  AdamW opt(params, AdamWOptions(1e-2));
  GradScaler scaler(scaler_options());
  for (int step = 0; step < kSteps; ++step) {
    std::vector<at::Tensor> acc;
    for (const auto& p : params) acc.push_back(at::zeros_like(p));
    for (int m = 0; m < kMicro; ++m) {
      std::vector<at::Tensor> total;
      for (const auto& p : params) total.push_back(at::zeros_like(p));
      for (int k = 0; k < world; ++k) {
        const int r = reversed ? world - 1 - k : k;
        auto [x, y] = batch_of(step, m, r);
        auto grads = torch::autograd::grad({scaler.scale((net->forward(x) - y).square().mean() / kMicro)}, params);
        for (size_t i = 0; i < params.size(); ++i) total[i] = total[i] + grads[i];
      }
      for (size_t i = 0; i < params.size(); ++i) acc[i] = acc[i] + total[i] / world;
    }
    for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = acc[i];
    scaler.clip_grad_norm_(opt, 1.0);
    scaler.step(opt);
    scaler.update();
  }
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone());
  return out;
}

void scenario_train(Communicator& comm) {
  const auto first = train_sharded(comm);
  const auto second = train_sharded(comm);
  for (size_t i = 0; i < first.size(); ++i) WORKER_CHECK(at::equal(first[i], second[i]), "run 2 differs at {}", i);
  gpuops::dist::Agreement agreement("trained parameters");
  agreement.field("parameters' bits", gpuops::dist::fingerprint(first));
  agreement.exchange(comm);  // raises on every rank when any two ranks hold other bits
  // Within the distance between two equally valid float32 references (parity_bound.h): the ranks' gradients
  // summed in one order and in the other (Gloo sums in a third).
  const auto ref = train_reference(comm.size()), other = train_reference(comm.size(), /*reversed=*/true);
  const Parity p = parity(first, ref, other);
  WORKER_CHECK(p.holds(), "max relative error {} against single-process > {} (the two references: {})", p.worst,
               p.bound(), p.noise);
  write_file(fmt::format("{}/result.{}", env_or("GPUOPS_COMM_DIR", "."), comm.rank()),
             fmt::format("max_rel_err={:.3g} (the two references: {:.3g})", p.worst, p.noise));
}

void scenario_bad_input(Communicator& comm) {
  // A layer sharing another's parameter (tied): refused naming both.
  auto a = torch::nn::Linear(4, 4);
  auto m = value_error_of([&] { gpuops::optim::sequential_units(torch::nn::Sequential(a, torch::nn::Tanh(), a)); });
  WORKER_CHECK(m.find("'2.weight' is the parameter '0.weight'") != std::string::npos, "tied: got '{}'", m);
  // A stage-2 optimizer, and a stage-3 one over other layers.
  auto net = make_net();
  auto units = gpuops::optim::sequential_units(net);
  ZeroOptimizer two(units.params, comm, 2, AdamWOptions(1e-2));
  m = value_error_of([&] { ShardedSequential(net, two); });
  WORKER_CHECK(m.find("must be stage 3") != std::string::npos, "stage 2: got '{}'", m);
  auto other = make_net();
  auto other_units = gpuops::optim::sequential_units(other);
  ZeroOptions zero;
  zero.stage = 3;
  zero.units = other_units.units;
  ZeroOptimizer three(other_units.params, comm, zero, AdamWOptions(1e-2));
  auto fresh = make_net();
  m = value_error_of([&] { ShardedSequential(fresh, three); });
  WORKER_CHECK(m.find("does not hold the parameters of the optimizer's unit 0") != std::string::npos,
               "other layers: got '{}'", m);
  // Units that are not numbered 0 .. U-1, a unit call out of range: named, on every rank.
  const auto fresh_params = gpuops::optim::sequential_units(fresh).params;
  zero.units.back() = static_cast<int64_t>(zero.units.size()) - 1;  // 3 units over 6 parameters: 3 and 4 empty
  m = value_error_of([&] { ZeroOptimizer(fresh_params, comm, zero, AdamWOptions(1e-2)); });
  WORKER_CHECK(m.find("unit 3 has no parameter") != std::string::npos, "units with a gap: got '{}'", m);
  // Unit numbers past the parameter count, up to INT64_MAX (wrapped the count, then a segfault; 2^40 bad_alloc).
  for (const int64_t unit : {static_cast<int64_t>(zero.units.size()), int64_t{1} << 40, INT64_MAX, INT64_MIN}) {
    zero.units.back() = unit;
    m = value_error_of([&] { ZeroOptimizer(fresh_params, comm, zero, AdamWOptions(1e-2)); });
    WORKER_CHECK(m.find(fmt::format("must be in [0, {})", zero.units.size())) != std::string::npos &&
                     m.find(std::to_string(unit)) != std::string::npos,
                 "unit {}: got '{}'", unit, m);
  }
  m = value_error_of([&] { three.shards().unit_pre_forward(3); });
  WORKER_CHECK(m.find("unit 3 is out of range [0, 3)") != std::string::npos, "unit out of range: got '{}'", m);
  // Ranks gathering different units, or one unit for different reasons (here with and without autograd):
  // every rank raises naming each rank's unit (Gloo aborted the process on the mismatched gather), and the
  // group stays usable: the next agreed gather runs.
  m = value_error_of([&] { three.shards().unit_pre_forward(static_cast<size_t>(comm.rank())); });
  WORKER_CHECK(m.find("rank 0 unit 0 for a forward, rank 1 unit 1 for a forward") != std::string::npos,
               "different units: got '{}'", m);
  m = value_error_of([&] {
    std::optional<torch::NoGradGuard> no_grad;
    if (comm.rank() == 1) no_grad.emplace();
    three.shards().unit_pre_forward(0);
  });
  WORKER_CHECK(m.find("rank 0 unit 0 for a forward, rank 1 unit 0 for a forward without autograd") !=
                   std::string::npos, "with and without autograd: got '{}'", m);
  three.shards().unit_pre_forward(0);
  three.shards().unit_post_forward(0);
  // The optimizer destroyed between a forward and its backward (the backward used freed memory): named.
  ZeroOptions fresh_zero;
  fresh_zero.stage = 3;
  fresh_zero.units = gpuops::optim::sequential_units(fresh).units;
  auto owned = std::make_unique<ZeroOptimizer<AdamW>>(fresh_params, comm, fresh_zero, AdamWOptions(1e-2));
  ShardedSequential model(fresh, *owned);
  const auto [x, y] = batch_of(0, 0, comm.rank());
  at::Tensor loss = (model->forward(x) - y).square().mean();
  owned.reset();
  m = value_error_of([&] { loss.backward(); });
  WORKER_CHECK(m.find("was destroyed before its backward") != std::string::npos, "destroyed: got '{}'", m);
  m = value_error_of([&] { model->forward(x); });
  WORKER_CHECK(m.find("its ZeroOptimizer was destroyed") != std::string::npos, "forward after: got '{}'", m);
  // A layer pushed after the wrap (it gave std::out_of_range).
  auto grown = make_net();
  const auto grown_units = gpuops::optim::sequential_units(grown);
  ZeroOptions grown_zero;
  grown_zero.stage = 3;
  grown_zero.units = grown_units.units;
  ZeroOptimizer<AdamW> grown_opt(grown_units.params, comm, grown_zero, AdamWOptions(1e-2));
  ShardedSequential grown_model(grown, grown_opt);
  grown->push_back(torch::nn::Linear(kOut, kOut));
  m = value_error_of([&] { grown_model->forward(x); });
  WORKER_CHECK(m.find("cannot be added or removed after the wrap") != std::string::npos, "push_back: got '{}'", m);
  comm.barrier().wait();
}

// Checkpoints through the C++ TrainingState: 3 ranks train 3 steps and save; 2 ranks, then 1, load it
// (resharded online) and hold the same parameters, bit for bit (the parameters live in the shard files).
void scenario_checkpoint(Communicator& comm) {
  const std::string dir = env_or("GPUOPS_ZERO_CKPT", "/tmp/zero3-ckpt");
  auto net = make_net();
  auto units = gpuops::optim::sequential_units(net);
  ZeroOptions zero;
  zero.stage = 3;
  zero.units = units.units;
  zero.param_names = units.names;
  zero.reduce_in_backward = true;
  ZeroOptimizer opt(units.params, comm, zero, AdamWOptions(1e-2));
  ShardedSequential model(net, opt);
  gpuops::TrainingStateOptions so;
  so.process_group = comm.process_group()->getBackend(c10::DeviceType::CPU);
  gpuops::TrainingState state(dir, so);
  gpuops::TrainingObjects objects;
  objects.optimizer = &opt;
  if (comm.size() == 3) {
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      auto [x, y] = batch_of(step, 0, comm.rank());
      (model->forward(x) - y).square().mean().backward();
      opt.step();
    }
    gpuops::TrainingProgress progress;
    progress.step = 3;
    // A unit gathered (between a forward and its backward): refused on every rank, nothing saved (the model's
    // full parameters went into a state no later model could load).
    opt.shards().unit_pre_forward(2);
    std::string refused;
    try {
      state.save(progress, objects);
    } catch (const c10::ValueError& e) {
      refused = e.what_without_backtrace();
    }
    WORKER_CHECK(refused.find("stage-3 units are gathered now") != std::string::npos, "gathered save: '{}'", refused);
    opt.shards().unit_post_forward(2);
    state.save(progress, objects);
    const auto full = opt.shards().full_parameters(0);
    if (comm.rank() == 0) torch::save(full, dir + "/params3.pt");
    return;
  }
  const auto loaded = state.load(objects, true, /*allow_reshard=*/true);
  WORKER_CHECK(loaded && loaded->step == 3, "loaded step {}", loaded ? loaded->step : -1);
  const auto full = opt.shards().full_parameters(0);
  if (comm.rank() == 0) {
    std::vector<at::Tensor> saved;
    torch::load(saved, dir + "/params3.pt");
    WORKER_CHECK(saved.size() == full.size(), "{} parameters saved, {} loaded", saved.size(), full.size());
    for (size_t i = 0; i < full.size(); ++i) WORKER_CHECK(at::equal(full[i], saved[i]), "parameter {} differs", i);
  }
  opt.zero_grad();  // and it trains on
  auto [x, y] = batch_of(3, 0, comm.rank());
  (model->forward(x) - y).square().mean().backward();
  opt.step();
}

int run_worker(const std::string& scenario) {
  return run_scenario(scenario, {{"train", scenario_train}, {"bad_input", scenario_bad_input},
                                 {"checkpoint", scenario_checkpoint}});
}

void run_train(int n) {
  const auto t0 = Clock::now();
  auto ranks = spawn(n, "train", 30000);
  const bool in_time = wait_ranks(ranks, t0 + std::chrono::seconds(55));
  EXPECT_TRUE(in_time) << "ranks still running after 55 s\n" << ranks.logs();
  for (int r = 0; r < n; ++r) EXPECT_EQ(ranks.status[r], 0) << "rank " << r << "\n" << ranks.logs();
  std::printf("[ stage 3, %d ranks: %.2f s; rank 0: %s ]\n", n,
              std::chrono::duration<double>(Clock::now() - t0).count(), read_file(ranks.dir + "/result.0").c_str());
}

TEST(ZeroStage3, ShardedSequentialTwoRanks) { run_train(2); }
TEST(ZeroStage3, ShardedSequentialThreeRanks) { run_train(3); }
TEST(ZeroStage3, BadInputTwoRanks) { run_all_ok(2, "bad_input"); }
TEST(ZeroStage3, TrainingStateReshards3To2To1) {
  char tmpl[] = "/tmp/gpuops-zero3-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  ::setenv("GPUOPS_ZERO_CKPT", tmpl, 1);
  for (int n : {3, 2, 1}) run_all_ok(n, "checkpoint");
}

}  // namespace

int main(int argc, char** argv) {
  if (const char* scenario = std::getenv("GPUOPS_COMM_WORKER")) return run_worker(scenario);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
