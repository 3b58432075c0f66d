// A LibTorch program that uses the installed gpuops package: which device it runs on, what the
// estimator predicts for its model's persistent state, and the peak it really reaches in two AdamW
// steps under a gpuops::MemoryBudget.
#include <cstdio>

#include <torch/torch.h>

#include <gpuops/gpuops.h>

int main() {
  const auto device = gpuops::device_info();
  std::printf("device: %s (%s), %.1f GiB total\n", device.name.c_str(), device.type.c_str(),
              device.total_memory_bytes / double(1 << 30));

  torch::manual_seed(0);
  torch::nn::Sequential mlp(torch::nn::Linear(512, 2048), torch::nn::GELU(), torch::nn::Linear(2048, 512));
  int64_t parameters = 0;
  for (const auto& p : mlp->parameters()) parameters += p.numel();

  namespace est = gpuops::estimator;
  est::TrainingSetup setup;
  setup.precision = est::Precision::Fp32;
  setup.optimizer = est::OptimizerKind::AdamW;
  const auto estimate = est::estimate_memory(est::params_only_model(parameters, "mlp"), setup, est::cpu_device());
  const int64_t states = estimate.weights + estimate.gradients + estimate.optimizer_states;

  torch::optim::AdamW optimizer(mlp->parameters(), torch::optim::AdamWOptions(1e-3));
  const auto x = torch::randn({64, 512});
  int64_t peak = 0;
  {
    gpuops::MemoryBudget budget;
    for (int step = 0; step < 2; ++step) {
      optimizer.zero_grad();
      mlp->forward(x).pow(2).mean().backward();
      optimizer.step();
    }
    peak = budget.peak_bytes();
  }
  const int64_t weights = parameters * 4;  // allocated before the budget, so not in its count
  std::printf("parameters: %lld\n", static_cast<long long>(parameters));
  std::printf("estimated weights + gradients + AdamW states: %.2f MiB\n", states / double(1 << 20));
  std::printf("measured peak (weights + everything the steps allocated): %.2f MiB\n",
              (weights + peak) / double(1 << 20));
  return (weights + peak) >= states ? 0 : 1;  // the steps hold at least the persistent state
}
