// CUDA only (skipped without a GPU): the C++ AMP step on the device gives the CPU step's bits, makes no host
// sync in steady state (torch's sync debug mode set to error), and replays from a CUDA graph.
#include <gtest/gtest.h>

#include <vector>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/optim/schedulers/step_lr.h>

#include "gpuops/grad_scaler.h"
#include "gpuops/optimizers.h"

namespace {

using gpuops::amp::GradScaler;
using gpuops::amp::GradScalerOptions;

#define REQUIRE_CUDA() \
  if (!at::hasCUDA()) GTEST_SKIP() << "needs a CUDA device"

std::vector<at::Tensor> leaves(const std::vector<at::Tensor>& values, at::Device device) {
  std::vector<at::Tensor> out;
  for (const auto& v : values) out.push_back(v.to(device).detach().requires_grad_(true));
  return out;
}

GradScalerOptions small_scale() {
  GradScalerOptions o;
  o.init_scale = 512.0;
  return o;
}

// One AMP step on given (scaled) gradients: clip (pass 1) unless told not to, fused step (pass 2), update.
void amp_step(GradScaler& scaler, gpuops::optim::AdamW& optimizer, std::vector<at::Tensor>& params,
              const std::vector<at::Tensor>& grads, bool clip = true) {
  for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad().copy_(grads[i]);
  (void)scaler.scale(params[0].sum());  // the scaler's state lives on the parameters' device
  if (clip) scaler.clip_grad_norm_(optimizer, 1.0);
  scaler.step(optimizer);
  scaler.update();
}

std::vector<at::Tensor> scaled_grads(const std::vector<at::Tensor>& params, at::Device device) {
  std::vector<at::Tensor> grads;
  for (const auto& p : params) grads.push_back((at::randn(p.sizes()) * 512.0f).to(device));
  return grads;
}

std::vector<at::Tensor> zero_grads_like(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(at::zeros_like(p));
  return out;
}

std::vector<at::Tensor> start_values() {
  // the last: a length that is a multiple of the kernels' lanes, over two chunks (their vector-load path)
  return {at::randn({7}), at::randn({33, 17}), at::randn({65537}), at::randn({3, 5}), at::randn({2, 65540})};
}

// One element math on both sides (kernels/math, no FMA contraction on either): the same bits without
// clipping; with it, the clip coefficient comes from norms summed in different orders, so close only.
TEST(CudaAmpStep, GivesTheCpuStepsBits) {
  REQUIRE_CUDA();
  for (const bool clip : {false, true}) {
    const auto start = start_values();
    auto on_cpu = leaves(start, at::kCPU), on_gpu = leaves(start, at::kCUDA);
    for (auto* set : {&on_cpu, &on_gpu})
      for (auto& p : *set) p.mutable_grad() = at::zeros_like(p);
    gpuops::optim::AdamW cpu_opt(on_cpu, gpuops::optim::AdamWOptions(1e-3).weight_decay(0.05));
    gpuops::optim::AdamW gpu_opt(on_gpu, gpuops::optim::AdamWOptions(1e-3).weight_decay(0.05));
    GradScaler cpu_scaler(small_scale()), gpu_scaler(small_scale());
    for (int step = 0; step < 20; ++step) {
      const auto grads = scaled_grads(on_cpu, at::kCPU);
      std::vector<at::Tensor> device_grads;
      for (const auto& g : grads) device_grads.push_back(g.cuda());
      amp_step(cpu_scaler, cpu_opt, on_cpu, grads, clip);
      amp_step(gpu_scaler, gpu_opt, on_gpu, device_grads, clip);
    }
    EXPECT_EQ(cpu_scaler.get_scale(), gpu_scaler.get_scale());
    for (size_t i = 0; i < on_cpu.size(); ++i) {
      const auto back = on_gpu[i].cpu();
      EXPECT_TRUE(clip ? at::allclose(on_cpu[i], back, 1e-5, 1e-6) : at::equal(on_cpu[i], back)) << i << clip;
    }
  }
}

TEST(CudaAmpStep, SteadyStateStepMakesNoHostSync) {
  REQUIRE_CUDA();
  auto params = leaves(start_values(), at::kCUDA);
  for (auto& p : params) p.mutable_grad() = at::zeros_like(p);
  gpuops::optim::AdamW optimizer(params, gpuops::optim::AdamWOptions(1e-3));
  GradScaler scaler(small_scale());
  amp_step(scaler, optimizer, params, scaled_grads(params, at::kCUDA));  // warm-up: state is made here
  auto overflow = scaled_grads(params, at::kCUDA);
  overflow[2][100] = INFINITY;
  const auto clean = scaled_grads(params, at::kCUDA);
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
  try {
    amp_step(scaler, optimizer, params, clean);
    amp_step(scaler, optimizer, params, overflow);  // the skip is sync-free too
    amp_step(scaler, optimizer, params, clean);
  } catch (...) {
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    throw;
  }
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  EXPECT_EQ(scaler.skipped_steps(), 1);
  EXPECT_EQ(scaler.get_scale(), 256.0);
}

TEST(CudaAmpStep, ReplaysFromACudaGraphFollowingTheLrSchedule) {
  REQUIRE_CUDA();
  const auto start = start_values();
  auto eager = leaves(start, at::kCUDA), graphed = leaves(start, at::kCUDA);
  for (auto* set : {&eager, &graphed})
    for (auto& p : *set) p.mutable_grad() = at::zeros_like(p);
  // The graphed optimizer reads lr on the device (capturable), so the schedule below reaches the replays;
  // the eager one is given the float32 value that tensor holds.
  const double lr = static_cast<float>(1e-3);
  gpuops::optim::AdamW eager_opt(eager, gpuops::optim::AdamWOptions(lr)),
      graphed_opt(graphed, gpuops::optim::AdamWOptions(lr).capturable(true));
  GradScaler eager_scaler(small_scale()), graphed_scaler(small_scale());
  auto static_grads = zero_grads_like(graphed);
  c10::cuda::device_synchronize();  // the side stream below does not wait for the fills above by itself
  {  // warm-up on a side stream, as capture asks
    c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
    for (int i = 0; i < 2; ++i) {
      const auto grads = scaled_grads(eager, at::kCUDA);
      amp_step(eager_scaler, eager_opt, eager, grads);
      amp_step(graphed_scaler, graphed_opt, graphed, grads);
    }
    c10::cuda::device_synchronize();
  }
  at::cuda::CUDAGraph graph;
  {
    c10::cuda::CUDAStreamGuard capture(c10::cuda::getStreamFromPool());
    graph.capture_begin();
    amp_step(graphed_scaler, graphed_opt, graphed, static_grads);
    graph.capture_end();
  }
  torch::optim::StepLR schedule(graphed_opt, /*step_size=*/2, /*gamma=*/0.3);
  for (int step = 0; step < 6; ++step) {
    const double now = graphed_opt.param_groups()[0].options().get_lr();
    eager_opt.param_groups()[0].options().set_lr(static_cast<float>(now));
    auto grads = scaled_grads(eager, at::kCUDA);
    if (step == 3) grads[1][2][4] = NAN;
    for (size_t i = 0; i < grads.size(); ++i) static_grads[i].copy_(grads[i]);
    graph.replay();
    amp_step(eager_scaler, eager_opt, eager, grads);
    ASSERT_EQ(graphed_scaler.get_scale(), eager_scaler.get_scale()) << step;
    schedule.step();
  }
  // LibTorch's StepLR decays on its 2nd and 4th step() of six (its count starts at 0, unlike Python's): twice.
  EXPECT_DOUBLE_EQ(graphed_opt.param_groups()[0].options().get_lr(), lr * 0.3 * 0.3);
  EXPECT_EQ(graphed_scaler.skipped_steps(), 1);
  EXPECT_EQ(eager_scaler.skipped_steps(), 1);
  for (size_t i = 0; i < eager.size(); ++i) EXPECT_TRUE(at::equal(eager[i], graphed[i])) << i;  // same kernels
}

}  // namespace
