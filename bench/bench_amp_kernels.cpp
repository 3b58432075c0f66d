// Google Benchmark for the AMP kernels, each next to torch's own op on the same tensors in the same run:
//   unscale        gpuops::amp::unscale_and_check_  vs at::_amp_foreach_non_finite_check_and_unscale_
//   grad_norm      gpuops::amp::unscaled_grad_norm_ vs at::_foreach_norm
//   adamw          gpuops::optim::adam_step_        vs at::_fused_adamw_
// on the CPU, and on CUDA when a device is present. bytes_per_second counts what each kernel reads and
// writes (4 bytes per fp32 element and array touched).
//
//   build/py/bench/bench_amp_kernels --benchmark_min_time=0.2
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <torch/cuda.h>

#include "gpuops/amp.h"
#include "gpuops/fused_adam.h"

namespace {

constexpr int kTensors = 8;

struct Lists {
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
  at::Tensor found_inf, inv_scale;
};

Lists make_lists(int64_t total, c10::Device device) {
  Lists l;
  const auto f32 = at::TensorOptions(device).dtype(at::kFloat);
  for (int t = 0; t < kTensors; ++t) {
    const int64_t n = total / kTensors;
    l.params.push_back(at::randn({n}, f32) * 0.02);
    l.grads.push_back(at::randn({n}, f32));
    l.exp_avgs.push_back(at::zeros({n}, f32));
    l.exp_avg_sqs.push_back(at::zeros({n}, f32));
    l.steps.push_back(at::zeros({}, f32));
  }
  l.found_inf = at::zeros({1}, f32);
  l.inv_scale = at::ones({1}, f32);
  return l;
}

void sync(c10::Device device) {
  if (device.is_cuda()) torch::cuda::synchronize();
}

// Runs `body` per iteration on `total` elements, counting `bytes_per_element`.
template <typename Body>
void run(benchmark::State& state, c10::Device device, int64_t bytes_per_element, Body body) {
  const int64_t total = state.range(0);
  Lists l = make_lists(total, device);
  body(l);  // warm-up (and lazy state)
  sync(device);
  for (auto _ : state) {
    body(l);
    sync(device);
  }
  state.SetBytesProcessed(state.iterations() * total * bytes_per_element);
}

void register_all(c10::Device device) {
  const std::string on = device.is_cuda() ? "cuda" : "cpu";
  auto add = [&](const std::string& name, int64_t bytes, auto body) {
    benchmark::RegisterBenchmark((name + "/" + on).c_str(),
                                 [=](benchmark::State& s) { run(s, device, bytes, body); })
        ->RangeMultiplier(16)
        ->Range(1 << 16, 1 << 24)
        ->Unit(benchmark::kMicrosecond)
        ->UseRealTime();
  };
  add("unscale/torch", 8, [](Lists& l) {
    at::_amp_foreach_non_finite_check_and_unscale_(l.grads, l.found_inf, l.inv_scale);
  });
  add("unscale/gpuops", 8, [](Lists& l) { gpuops::amp::unscale_and_check_(l.grads, l.found_inf, l.inv_scale); });
  add("grad_norm/torch", 4, [](Lists& l) { benchmark::DoNotOptimize(at::_foreach_norm(l.grads)); });
  add("grad_norm/gpuops", 4, [](Lists& l) {
    benchmark::DoNotOptimize(gpuops::amp::unscaled_grad_norm_(l.grads, l.inv_scale, l.found_inf));
  });
  add("adamw/torch", 28, [](Lists& l) {
    at::_fused_adamw_(l.params, l.grads, l.exp_avgs, l.exp_avg_sqs, {}, l.steps, 1e-3, 0.9, 0.999, 1e-2, 1e-8, false,
                      false);
  });
  add("adamw/gpuops", 28, [](Lists& l) {
    gpuops::optim::AdamStepOptions o;
    o.weight_decay = 1e-2;
    gpuops::optim::adam_step_(l.params, l.grads, l.exp_avgs, l.exp_avg_sqs, {}, l.steps, o, std::nullopt,
                              std::nullopt);
  });
}

}  // namespace

int main(int argc, char** argv) {
  register_all(c10::Device(c10::kCPU));
  if (at::hasCUDA()) register_all(c10::Device(c10::kCUDA, 0));
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
