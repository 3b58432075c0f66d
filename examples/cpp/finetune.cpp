// A complete LibTorch fine-tuning loop with gpuops, the C++ twin of examples/python/finetune.py: mixed
// precision (AutocastGuard; GradScaler for fp16 on CUDA, bf16 on the CPU), activation checkpointing of every
// second block (CheckpointedSequential), gradient accumulation normalised by the window's token count
// (GradAccumulator), a preemption-safe TrainingState (periodic saves, a save on SIGTERM/SIGUSR1, resume), and the
// training's figures, one record per 10 steps in <state-dir>.metrics.jsonl (MetricsRecorder: loss, gradient norm,
// tokens/s, checkpoint saves; TensorBoard files in <state-dir>.tb), continued across a resume without a step twice.
//
//   build/examples/finetune <state-dir> [steps=40] [signal-self-at-step]
// Run it again with the same folder to resume where it stopped.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <gpuops/gpuops.h>
#include <gpuops/telemetry.h>

namespace {

constexpr int64_t kVocab = 64, kWidth = 64, kLayers = 4, kSeq = 32, kMicroBatch = 8, kWindow = 4, kPad = -100;

// A pre-norm transformer block: causal self-attention and an MLP, with dropout.
struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : norm1(register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})))),
        qkv(register_module("qkv", torch::nn::Linear(kWidth, 3 * kWidth))),
        proj(register_module("proj", torch::nn::Linear(kWidth, kWidth))),
        norm2(register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})))),
        up(register_module("up", torch::nn::Linear(kWidth, 4 * kWidth))),
        down(register_module("down", torch::nn::Linear(4 * kWidth, kWidth))),
        dropout(register_module("dropout", torch::nn::Dropout(0.1))) {}

  torch::Tensor forward(const torch::Tensor& x) {
    const auto b = x.size(0), s = x.size(1);
    auto heads = qkv(norm1(x)).view({b, s, 3, 4, kWidth / 4}).permute({2, 0, 3, 1, 4});
    auto attended = at::scaled_dot_product_attention(heads[0], heads[1], heads[2], {}, 0.0, /*is_causal=*/true);
    auto h = x + dropout(proj(attended.transpose(1, 2).reshape({b, s, kWidth})));
    return h + dropout(down(torch::gelu(up(norm2(h)))));
  }

  torch::nn::LayerNorm norm1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm norm2;
  torch::nn::Linear up, down;
  torch::nn::Dropout dropout;
};
TORCH_MODULE(Block);

struct TinyLMImpl : torch::nn::Module {
  TinyLMImpl()
      : embed(register_module("embed", torch::nn::Embedding(kVocab, kWidth))),
        blocks(register_module("blocks", gpuops::CheckpointedSequential(make_blocks()))),
        head(register_module("head", torch::nn::Linear(kWidth, kVocab))) {}

  static torch::nn::Sequential make_blocks() {
    torch::nn::Sequential blocks;
    for (int64_t i = 0; i < kLayers; ++i) blocks->push_back(Block());
    return blocks;
  }
  torch::Tensor forward(const torch::Tensor& tokens) { return head(blocks(embed(tokens))); }

  torch::nn::Embedding embed;
  gpuops::CheckpointedSequential blocks;
  torch::nn::Linear head;
};
TORCH_MODULE(TinyLM);

// The index-th micro-batch, the same on every run: sequences following a rule, of varying length.
std::pair<torch::Tensor, torch::Tensor> micro_batch(int64_t index, torch::Device device) {
  auto g = at::detail::createCPUGenerator(static_cast<uint64_t>(index));
  const auto start = at::randint(0, kVocab, {kMicroBatch, 1}, g);
  const auto tokens = (start + 3 * torch::arange(kSeq + 1)).remainder(kVocab);
  const auto lengths = at::randint(kSeq / 4, kSeq + 1, {kMicroBatch, 1}, g);
  auto targets = tokens.slice(1, 1).clone();
  targets.masked_fill_(torch::arange(kSeq).unsqueeze(0) >= lengths, kPad);
  return {tokens.slice(1, 0, kSeq).to(device), targets.to(device)};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: finetune <state-dir> [steps=40] [signal-self-at-step]\n");
    return 2;
  }
  const std::string state_dir = argv[1];
  const int64_t steps = argc > 2 ? std::atoll(argv[2]) : 40;
  const int64_t signal_at = argc > 3 ? std::atoll(argv[3]) : -1;
  if (steps < 1) {
    std::fprintf(stderr, "finetune: steps must be >= 1, got %s\n", argv[2]);
    return 2;
  }
  const torch::Device device = torch::cuda::is_available() ? torch::kCUDA : torch::kCPU;
  const auto dtype = device.is_cuda() ? torch::kHalf : torch::kBFloat16;

  torch::manual_seed(0);
  TinyLM model;
  model->to(device);
  const auto checkpointed = model->blocks->checkpoint_every(2);
  gpuops::optim::AdamW optimizer(model->parameters(), gpuops::optim::AdamWOptions(3e-3).weight_decay(0.01));
  gpuops::amp::GradScalerOptions scaling;
  scaling.init_scale = 4096;
  scaling.enabled = dtype == torch::kHalf;
  gpuops::amp::GradScaler scaler(scaling);
  gpuops::GradAccumulatorOptions accumulation;
  accumulation.window = kWindow;
  accumulation.max_norm = 1.0;
  gpuops::GradAccumulator accumulator(optimizer, accumulation, &scaler);

  gpuops::TrainingStateOptions keep_two;
  keep_two.keep = 2;
  gpuops::TrainingState state(state_dir, keep_two);
  const gpuops::TrainingObjects objects{model.get(), &optimizer, &scaler};
  const auto resumed = state.load(objects);
  const int64_t first_step = resumed ? resumed->step : 0;  // a state's step: the optimizer steps done
  std::printf("checkpointed blocks: %zu of %lld; %s\n", checkpointed.size(), static_cast<long long>(kLayers),
              resumed ? ("resumed from " + resumed->path).c_str() : "fresh start");

  const std::string run = state_dir.back() == '/' ? state_dir.substr(0, state_dir.size() - 1) : state_dir;
  gpuops::telemetry::RecorderOptions telemetry;
  telemetry.jsonl_path = run + ".metrics.jsonl";
  if (gpuops::telemetry::tensorboard_available()) telemetry.tensorboard_dir = run + ".tb";
  gpuops::telemetry::MetricsRecorder recorder(telemetry);

  for (int64_t step = first_step; step < steps; ++step) {
    double window_loss = 0;
    int64_t window_tokens = 0;
    for (int64_t micro = 0; micro < kWindow; ++micro) {
      const auto [tokens, targets] = micro_batch(step * kWindow + micro, device);
      torch::Tensor logits;
      {
        gpuops::amp::AutocastGuard autocast(device.type(), dtype);
        logits = model->forward(tokens);
      }
      const auto loss_sum = torch::nn::functional::cross_entropy(
          logits.to(torch::kFloat).flatten(0, 1), targets.flatten(),
          torch::nn::functional::CrossEntropyFuncOptions().ignore_index(kPad).reduction(torch::kSum));
      const int64_t count = targets.ne(kPad).sum().item<int64_t>();
      accumulator.backward(loss_sum, static_cast<double>(count));  // steps on the window's last micro-batch
      window_loss += loss_sum.item<double>();
      window_tokens += count;
    }
    gpuops::telemetry::StepReport report;  // optimizer step `step + 1` done (the norm stays on its device)
    report.loss = torch::tensor(window_loss / static_cast<double>(window_tokens), torch::kDouble);
    report.grad_norm = accumulator.last_grad_norm();
    report.lrs = {optimizer.param_groups()[0].options().get_lr()};
    report.tokens = window_tokens;
    report.samples = kWindow * kMicroBatch;
    recorder.step_done(step + 1, report);
    std::printf("step %lld loss %.9g\n", static_cast<long long>(step), window_loss / window_tokens);
    std::fflush(stdout);
    if (step == signal_at) std::raise(SIGUSR1);  // what a scheduler sends before a kill
    const bool stop = state.should_stop();
    if (stop || (step + 1) % 10 == 0 || step == steps - 1) {
      gpuops::TrainingProgress progress;
      progress.step = step + 1;
      progress.data_position = (step + 1) * kWindow;
      const auto path = state.save(progress, objects);
      if (stop) {
        recorder.close();
        std::printf("stop requested: saved %s after %lld steps; run again to resume\n", path.c_str(),
                    static_cast<long long>(step + 1));
        return 0;
      }
    }
  }
  recorder.close();
  std::printf("done\n");
  return 0;
}
