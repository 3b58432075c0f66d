// CheckpointedSequential (checkpointed_sequential.h): policies over gpuops::checkpoint.
#include "gpuops/checkpointed_sequential.h"

#include <algorithm>
#include <chrono>
#include <set>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#ifdef GPUOPS_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "gpuops/checkpoint.h"
#include "gpuops/memory_budget.h"

namespace gpuops {
namespace {

void wait_for(const at::Tensor& t) {  // timings on CUDA need the kernels finished
#ifdef GPUOPS_WITH_CUDA
  if (t.is_cuda()) c10::cuda::device_synchronize();
#else
  (void)t;
#endif
}

int64_t storage_bytes(const at::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.storage().nbytes()) : 0;
}

}  // namespace

CheckpointedSequentialImpl::CheckpointedSequentialImpl(torch::nn::Sequential layers_)
    : layers(register_module("layers", std::move(layers_))) {
  sync_layers();
}

void CheckpointedSequentialImpl::sync_layers() const {
  std::vector<std::string> now;
  for (const auto& item : layers->named_children()) now.push_back(item.key());
  if (now == names_) return;
  std::vector<bool> chosen(now.size(), false);
  for (size_t i = 0; i < now.size(); ++i) {
    const auto was = std::find(names_.begin(), names_.end(), now[i]);
    if (was != names_.end()) chosen[i] = checkpointed_[static_cast<size_t>(was - names_.begin())];
  }
  names_ = std::move(now);
  checkpointed_ = std::move(chosen);
}

at::Tensor CheckpointedSequentialImpl::forward(at::Tensor x) {
  sync_layers();
  size_t i = 0;
  for (auto& layer : *layers) {
    if (!checkpointed_[i++] || !c10::GradMode::is_enabled()) {
      x = layer.forward(x);
      continue;
    }
    CheckpointOptions options;
    options.buffers = layer.ptr()->buffers();
    auto* module = &layer;
    std::vector<at::Tensor> inputs{x};
    // An input that does not require grad (the data, before the first layer) gets a companion that does,
    // so the backward reaches this segment and its parameters get their gradients.
    if (!x.requires_grad()) inputs.push_back(at::empty({0}, x.options()).requires_grad_(true));
    x = checkpoint([module](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{module->forward(in[0])}; },
                   inputs, options)[0];
  }
  return x;
}

std::vector<std::string> CheckpointedSequentialImpl::choose(const std::vector<bool>& chosen) {
  checkpointed_ = chosen;
  return checkpointed();
}

std::vector<std::string> CheckpointedSequentialImpl::checkpoint_every(int64_t k) {
  sync_layers();
  TORCH_CHECK_VALUE(k >= 1, "CheckpointedSequential::checkpoint_every: k must be >= 1, got ", k);
  std::vector<bool> chosen(names_.size());
  for (size_t i = 0; i < chosen.size(); ++i) chosen[i] = i % static_cast<size_t>(k) == 0;
  return choose(chosen);
}

std::vector<std::string> CheckpointedSequentialImpl::checkpoint_named(const std::vector<std::string>& names) {
  sync_layers();
  const std::set<std::string> known(names_.begin(), names_.end());
  for (const auto& name : names) {
    if (known.count(name)) continue;
    std::string accepted;
    for (const auto& n : names_) accepted += (accepted.empty() ? "" : ", ") + n;
    TORCH_CHECK_VALUE(false, "CheckpointedSequential::checkpoint_named: names has '", name,
                      "', which is not a layer; accepted: ", accepted);
  }
  std::vector<bool> chosen(names_.size());
  for (size_t i = 0; i < chosen.size(); ++i) chosen[i] = std::count(names.begin(), names.end(), names_[i]) > 0;
  return choose(chosen);
}

std::vector<std::string> CheckpointedSequentialImpl::checkpoint_to_budget(int64_t budget_bytes,
                                                                          const at::Tensor& sample) {
  TORCH_CHECK_VALUE(budget_bytes >= 0, "CheckpointedSequential::checkpoint_to_budget: budget_bytes must be >= 0, "
                    "got ", budget_bytes);
  const auto picked = choose_for_budget(measure_layers(sample), budget_bytes);  // throws before any change
  std::vector<bool> chosen(names_.size(), false);
  for (size_t i : picked) chosen[i] = true;
  return choose(chosen);
}

void CheckpointedSequentialImpl::checkpoint_none() {
  sync_layers();
  checkpointed_.assign(names_.size(), false);
}

std::vector<LayerCost> CheckpointedSequentialImpl::measure_layers(const at::Tensor& sample) {
  sync_layers();
  TORCH_CHECK_VALUE(sample.defined(), "CheckpointedSequential::measure_layers: sample must be a defined tensor");
  {
    c10::NoGradGuard warm_up;  // first-call allocations and lazy initialisation out of the measurement
    at::Tensor x = sample;
    for (auto& layer : *layers) x = layer.forward(x);
  }
  c10::AutoGradMode with_grad(true);
  MemoryBudget counter(MemoryBudget::kUnlimited, sample.device());
  std::vector<at::Tensor> held{sample};  // every output stays alive, as in a training forward
  std::vector<LayerCost> costs;
  size_t i = 0;
  for (auto& layer : *layers) {
    const int64_t before = counter.current_bytes();
    wait_for(held.back());
    const auto start = std::chrono::steady_clock::now();
    held.push_back(layer.forward(held.back()));
    wait_for(held.back());
    const std::chrono::duration<double> seconds = std::chrono::steady_clock::now() - start;
    const int64_t output = storage_bytes(held.back());
    costs.push_back({names_[i++], std::max(counter.current_bytes() - before, output), output, seconds.count()});
  }
  return costs;
}

std::vector<std::string> CheckpointedSequentialImpl::checkpointed() const {
  sync_layers();
  std::vector<std::string> chosen;
  for (size_t i = 0; i < names_.size(); ++i)
    if (checkpointed_[i]) chosen.push_back(names_[i]);
  return chosen;
}

}  // namespace gpuops
