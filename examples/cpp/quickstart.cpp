// The smallest gpuops training program: gpuops' AdamW and a TrainingState that resumes (docs/guide.md shows
// this file). Run it twice with the same folder: the second run continues from the last save.
#include <cstdio>

#include <torch/torch.h>

#include <gpuops/gpuops.h>

int main(int argc, char** argv) {
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(8, 32), torch::nn::Tanh(), torch::nn::Linear(32, 1));
  gpuops::optim::AdamW optimizer(model->parameters(), gpuops::optim::AdamWOptions(1e-2));
  gpuops::TrainingState state(argc > 1 ? argv[1] : "run-cpp/");
  const gpuops::TrainingObjects objects{model.ptr().get(), &optimizer, nullptr};
  const auto resumed = state.load(objects);  // empty on the first run
  int64_t step = resumed ? resumed->step : 0;  // steps done
  for (; step < 50 && !state.should_stop(); ++step) {  // SIGTERM or SIGUSR1: save and stop
    const auto x = torch::randn({32, 8});
    const auto loss = (model->forward(x) - x.sum(1, /*keepdim=*/true)).square().mean();
    optimizer.zero_grad();
    loss.backward();
    optimizer.step();
    if ((step + 1) % 10 == 0 || state.should_stop()) {
      gpuops::TrainingProgress progress;
      progress.step = step + 1;  // steps done
      state.save(progress, objects);
      std::printf("step %lld loss %.6f saved\n", static_cast<long long>(step), loss.item<double>());
    }
  }
  std::printf("done at step %lld\n", static_cast<long long>(step));
}
