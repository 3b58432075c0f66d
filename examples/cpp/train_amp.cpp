// A mixed-precision LibTorch training loop with gpuops: AutocastGuard (torch.autocast for C++),
// GradScaler with fused clipping, and the fused gpuops::optim::AdamW driven by a torch LR scheduler.
// The C++ twin of examples/python/train_amp.py. Runs on CUDA (fp16 + loss scaling) when present, else on
// the CPU (bf16, scaler disabled: bf16 needs no loss scaling).
//
//   build/examples/train_amp [steps]
#include <cstdio>
#include <cstdlib>

#include <torch/torch.h>

#include <gpuops/gpuops.h>

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 50;
  if (steps < 1) {
    std::fprintf(stderr, "train_amp: steps must be >= 1, got %s\n", argv[1]);
    return 2;
  }
  torch::manual_seed(0);
  const torch::Device device = torch::cuda::is_available() ? torch::kCUDA : torch::kCPU;
  const auto dtype = device.is_cuda() ? torch::kHalf : torch::kBFloat16;

  // A small regression task: learn y = sin(W x) with an MLP.
  torch::nn::Sequential model(torch::nn::Linear(64, 256), torch::nn::GELU(), torch::nn::Linear(256, 8));
  model->to(device);
  const auto target_weights = torch::randn({64, 8}, device) / 8;
  gpuops::optim::AdamW optimizer(model->parameters(), gpuops::optim::AdamWOptions(3e-3).weight_decay(0.01));
  torch::optim::StepLR scheduler(optimizer, /*step_size=*/steps / 2 + 1, /*gamma=*/0.3);
  gpuops::amp::GradScalerOptions scaling;
  scaling.init_scale = 16384;
  scaling.enabled = dtype == torch::kHalf;
  gpuops::amp::GradScaler scaler(scaling);

  double first_loss = 0, last_loss = 0;
  for (int step = 0; step < steps; ++step) {
    const auto x = torch::randn({128, 64}, device);
    const auto y = torch::sin(x.matmul(target_weights));
    optimizer.zero_grad();
    torch::Tensor loss;
    {
      gpuops::amp::AutocastGuard autocast(device.type(), dtype);
      loss = torch::mse_loss(model->forward(x).to(torch::kFloat), y);
    }
    scaler.scale(loss).backward();
    const auto grad_norm = scaler.clip_grad_norm_(optimizer, /*max_norm=*/1.0);  // pass 1: flag + norm
    scaler.step(optimizer);  // pass 2: fused AdamW, skipped on the device after an overflow
    scaler.update();
    scheduler.step();
    last_loss = loss.item<double>();
    if (step == 0) first_loss = last_loss;
    if (step % 10 == 0 || step == steps - 1)
      std::printf("step %4d  loss %.4f  grad-norm %.3f  scale %.0f  skipped %lld\n", step, last_loss,
                  grad_norm.item<double>(), scaler.get_scale(), static_cast<long long>(scaler.skipped_steps()));
  }
  std::printf("loss %.4f -> %.4f\n", first_loss, last_loss);
  return last_loss < first_loss ? 0 : 1;
}
