#pragma once
// ZeRO stage 3 from C++ (issue 22): ShardedSequential runs the layers of a torch::nn::Sequential that are the
// units of a stage-3 ZeroOptimizer. LibTorch modules have no forward hooks, so this module runs the layers
// itself: before a layer its unit is gathered (and the next `prefetch` launched), after it the unit is freed
// (reshard_after_forward), and the layer's output passes through an autograd node that gathers the unit again
// when the backward reaches it. The layers' own code is not changed. A layer called directly, not through this
// module, runs on its empty placeholders: torch's op raises its own size error (LibTorch has no hook to name
// the cause; docs/architecture.md, "Reads outside a forward").
//
//   auto net = torch::nn::Sequential(embedding, block1, block2, head);
//   auto units = gpuops::optim::sequential_units(net);           // one unit per layer with parameters
//   gpuops::optim::ZeroOptions zero;
//   zero.stage = 3;
//   zero.units = units.units;
//   zero.param_names = units.names;
//   zero.reduce_in_backward = true;                                // each unit reduced as its backward ends
//   gpuops::optim::ZeroOptimizer opt(units.params, comm, zero, gpuops::optim::AdamWOptions(1e-3));
//   gpuops::optim::ShardedSequential model(net, opt);
//   opt.zero_grad(); loss_fn(model->forward(x), y).backward(); opt.step();

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include "gpuops/zero_optimizer.h"

namespace gpuops::optim {

/// The parameters of a Sequential's layers (those requiring grad), their names ("<layer>.<name>") and units:
/// one unit per layer that has such parameters, numbered in order (what ZeroOptions::units takes).
struct SequentialUnits {
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  std::vector<int64_t> units;
};

/// c10::ValueError for a parameter shared by two layers (tied: one unit would gather it, the other find a
/// placeholder), naming it and both layers.
SequentialUnits sequential_units(const torch::nn::Sequential& layers);

class ShardedSequentialImpl : public torch::nn::Module {
 public:
  /// `optimizer`: stage 3, built from sequential_units(layers). c10::ValueError when its units are not the
  /// layers' parameters, and from a forward, or the backward of an earlier forward, once it is destroyed.
  ShardedSequentialImpl(torch::nn::Sequential layers, ShardedOptimizer& optimizer);

  /// The layers in order, each unit gathered around its forward and, through the autograd graph, its backward.
  /// c10::ValueError when layers were added to or removed from the Sequential after the wrap.
  at::Tensor forward(at::Tensor x);

  torch::nn::Sequential layers;

 private:
  int64_t shards_key_;  ///< the optimizer's ZeroShards::live_key(): a forward or backward after it is gone raises
  std::vector<int64_t> unit_of_layer_;  ///< -1: a layer without trainable parameters
};

TORCH_MODULE(ShardedSequential);

}  // namespace gpuops::optim
