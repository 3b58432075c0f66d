#pragma once
// CheckpointedSequential: a torch::nn::Sequential whose layers are checkpointed (gpuops::checkpoint) by a
// policy: every k-th layer, named layers, or the set that fits a memory budget with the least recomputation,
// measured on a sample batch.

#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include "gpuops/checkpoint_policy.h"

namespace gpuops {

class CheckpointedSequentialImpl : public torch::nn::Module {
 public:
  /// Wraps `layers` (registered as the submodule "layers"); nothing is checkpointed until a policy is set.
  explicit CheckpointedSequentialImpl(torch::nn::Sequential layers);

  /// Runs the layers in order, checkpointing the chosen ones while grad mode is on. A chosen layer's
  /// in-place buffers (BatchNorm statistics) are updated once per step. The input need not require grad.
  at::Tensor forward(at::Tensor x);

  // Policies: each replaces the previous choice and returns the names of the layers now checkpointed.
  /// Layers 0, k, 2k, ... (k >= 1).
  std::vector<std::string> checkpoint_every(int64_t k);
  /// The layers with these names (a Sequential names them "0", "1", ... unless given names).
  std::vector<std::string> checkpoint_named(const std::vector<std::string>& names);
  /// The layers whose checkpointing makes the activations of a forward of `sample` fit in budget_bytes
  /// with the least recomputation time (measure_layers + choose_for_budget).
  std::vector<std::string> checkpoint_to_budget(int64_t budget_bytes, const at::Tensor& sample);
  /// Checkpoints nothing.
  void checkpoint_none();

  /// Runs one forward of `sample` with grad (plain, after a warm-up without grad) and measures per layer the
  /// bytes it leaves allocated (its saved activations and output) and its forward time.
  std::vector<LayerCost> measure_layers(const at::Tensor& sample);

  /// Names of the checkpointed layers, in order.
  std::vector<std::string> checkpointed() const;
  const std::vector<std::string>& layer_names() const {
    sync_layers();
    return names_;
  }

  /// The layers; ones added later (layers->push_back) are run and named, not checkpointed until a policy says.
  torch::nn::Sequential layers;

 private:
  std::vector<std::string> choose(const std::vector<bool>& chosen);
  /// Re-reads the layer names when `layers` changed, keeping each remaining layer's choice.
  void sync_layers() const;

  mutable std::vector<std::string> names_;
  mutable std::vector<bool> checkpointed_;
};

TORCH_MODULE(CheckpointedSequential);

}  // namespace gpuops
