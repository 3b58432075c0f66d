// Data-parallel training from C++ with gpuops::optim::ZeroOptimizer (ZeRO stage 2, or 3, over our fused AdamW) and a
// resumable TrainingState, launched by torchrun or any launcher that sets MASTER_ADDR, MASTER_PORT, RANK,
// WORLD_SIZE (or SLURM's srun: SLURM_PROCID, SLURM_NTASKS with MASTER_ADDR/MASTER_PORT exported):
//
//   torchrun --nproc_per_node 2 --no-python ./train_zero /tmp/zero-state 20
//   torchrun --nproc_per_node 1 --no-python ./train_zero /tmp/zero-state 40   # resumes, resharded
//
// Arguments: state folder, total steps, optionally the step at which the last rank sends itself SIGTERM (every
// rank then saves that step and exits 0; -1: none), and the ZeRO stage (2 by default; 3 shards the parameters
// too, each Linear a unit, the layers run by gpuops::optim::ShardedSequential). Rank 0 prints "step N loss X"
// (the global mean loss).
#include <csignal>
#include <cstdio>
#include <optional>
#include <string>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "gpuops/gpuops.h"
#include "gpuops/telemetry.h"

namespace {

// Slice `rank` of the global batch of `step` (the same global batch whatever the world size).
std::pair<torch::Tensor, torch::Tensor> batch(int64_t step, int rank, int world) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(step));
  const torch::Tensor x = at::randn({64, 8}, gen);
  const torch::Tensor y = torch::tanh(0.5 * x.sum(1, /*keepdim=*/true));
  const int64_t per = 64 / world;
  return {x.narrow(0, rank * per, per), y.narrow(0, rank * per, per)};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s STATE_DIR STEPS [SIGTERM_AT_STEP] [STAGE]\n", argv[0]);
    return 2;
  }
  const std::string state_dir = argv[1];
  const int64_t steps = std::stoll(argv[2]);
  const int64_t signal_at = argc > 3 ? std::stoll(argv[3]) : -1;
  const int stage = argc > 4 ? std::stoi(argv[4]) : 2;

  auto comm = gpuops::dist::Communicator::from_environment();
  const int rank = comm.rank(), world = comm.size();
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(8, 64), torch::nn::Tanh(), torch::nn::Linear(64, 1));
  gpuops::optim::ZeroOptions zero;
  zero.stage = stage;
  // The parameters, their names (they go into the checkpoints) and, for stage 3, a unit per Linear.
  const gpuops::optim::SequentialUnits units = gpuops::optim::sequential_units(model);
  zero.param_names = units.names;
  if (stage == 3) {
    zero.units = units.units;
    zero.reduce_in_backward = true;  // each unit's gradients reduced as its backward ends
  }
  gpuops::optim::ZeroOptimizer opt(units.params, comm, zero, gpuops::optim::AdamWOptions(3e-2));
  // Stage 3: the layers run through ShardedSequential, which gathers each unit around its forward and backward.
  std::optional<gpuops::optim::ShardedSequential> sharded;
  if (stage == 3) sharded.emplace(model, opt);
  const auto forward = [&](const torch::Tensor& x) { return sharded ? (*sharded)->forward(x) : model->forward(x); };

  gpuops::TrainingStateOptions state_options;
  state_options.process_group = comm.process_group()->getBackend(c10::DeviceType::CPU);  // agreed stop flag
  gpuops::TrainingState state(state_dir, state_options);
  gpuops::TrainingObjects objects;
  objects.model = model.ptr().get();
  objects.optimizer = &opt;
  int64_t start = 0;
  if (const auto loaded = state.load(objects, /*restore_rng=*/true, /*allow_reshard=*/true)) {
    start = loaded->step;
    if (rank == 0) std::printf("resumed from %s at step %lld on %d rank(s)\n", loaded->path.c_str(),
                               static_cast<long long>(start), world);
  }
  // The training figures, one record per 5 steps: rank 0 writes <state-dir>.metrics.jsonl, with the rates summed
  // over the ranks and the collective bytes per step (every rank records every step, through `comm`).
  gpuops::telemetry::RecorderOptions telemetry;
  telemetry.log_every = 5;
  telemetry.jsonl_path = (state_dir.back() == '/' ? state_dir.substr(0, state_dir.size() - 1) : state_dir) +
                         ".metrics.jsonl";
  telemetry.rank = rank;
  telemetry.world_size = world;
  gpuops::telemetry::MetricsRecorder recorder(telemetry, nullptr, &comm);
  for (int64_t step = start; step < steps; ++step) {
    opt.zero_grad();
    auto [x, y] = batch(step, rank, world);
    const torch::Tensor loss = torch::mse_loss(forward(x), y);
    loss.backward();
    opt.step();
    gpuops::telemetry::StepReport report;
    report.loss = loss.detach();
    report.samples = x.size(0);
    recorder.step_done(step + 1, report);
    torch::Tensor mean = loss.detach().clone().reshape({1});
    comm.all_reduce(mean, gpuops::dist::ReduceOp::Average).wait();
    if (rank == 0) std::printf("step %lld loss %.6f\n", static_cast<long long>(step), mean.item<double>());
    if (step == signal_at && rank == world - 1) std::raise(SIGTERM);  // as a scheduler would
    const bool stop = state.should_stop();  // agreed by every rank
    if (stop || (step + 1) % 5 == 0 || step + 1 == steps) {
      gpuops::TrainingProgress progress;
      progress.step = step + 1;
      const std::string path = state.save(progress, objects);
      if (stop) {
        if (rank == 0) std::printf("stop requested: saved %s\n", path.c_str());
        break;
      }
    }
    std::fflush(stdout);
  }
  recorder.close();  // every rank: the last record's figures over all ranks
  return 0;
}
