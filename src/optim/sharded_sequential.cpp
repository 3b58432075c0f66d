// gpuops::optim::ShardedSequential (sharded_sequential.h): stage-3 units around the layers of a Sequential, the
// backward side through a custom autograd function on each layer's output.
#include "gpuops/sharded_sequential.h"

#include <algorithm>
#include <unordered_map>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>

namespace gpuops::optim {
namespace {

// Identity in forward; in backward, before the unit's own nodes run (the gradient of its output arrives
// first), gathers the unit and prefetches the ones backward reaches next.
struct GatherForBackward : public torch::autograd::Function<GatherForBackward> {
  // `shards`: the optimizer's live_key(), not a pointer: the graph may outlive the optimizer.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t shards, int64_t unit) {
    ctx->saved_data["shards"] = shards;
    ctx->saved_data["unit"] = unit;
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    ZeroShards* shards = ZeroShards::find_live(ctx->saved_data["shards"].toInt());
    TORCH_CHECK_VALUE(shards != nullptr, "ShardedSequential: the ZeroOptimizer that ran this forward was "
                      "destroyed before its backward: keep the optimizer alive until every backward of its forwards "
                      "has run");
    shards->unit_pre_backward(static_cast<size_t>(ctx->saved_data["unit"].toInt()));
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};

}  // namespace

SequentialUnits sequential_units(const torch::nn::Sequential& layers) {
  SequentialUnits out;
  std::unordered_map<const c10::TensorImpl*, std::string> seen;
  int64_t unit = 0;
  for (const auto& item : layers->named_children()) {
    bool any = false;
    for (const auto& p : item.value()->named_parameters(/*recurse=*/true)) {
      if (!p.value().requires_grad()) continue;
      const std::string name = item.key() + "." + p.key();
      const auto [where, fresh] = seen.emplace(p.value().unsafeGetTensorImpl(), name);
      TORCH_CHECK_VALUE(fresh, "sequential_units: '", name, "' is the parameter '", where->second, "' of another "
                        "layer (tied or shared): a stage-3 unit is one layer, so put both users in one layer");
      out.params.push_back(p.value());
      out.names.push_back(name);
      out.units.push_back(unit);
      any = true;
    }
    if (any) ++unit;
  }
  return out;
}

ShardedSequentialImpl::ShardedSequentialImpl(torch::nn::Sequential layers_, ShardedOptimizer& optimizer)
    : layers(register_module("layers", std::move(layers_))), shards_key_(optimizer.shards().live_key()) {
  ZeroShards& shards = optimizer.shards();
  TORCH_CHECK_VALUE(shards.stage() == 3, "ShardedSequential: the optimizer must be stage 3, got stage ",
                    shards.stage());
  // Each layer with trainable parameters is the next unit, holding exactly them.
  size_t unit = 0;
  for (const auto& item : layers->named_children()) {
    std::vector<const c10::TensorImpl*> mine;
    for (const auto& p : item.value()->parameters(/*recurse=*/true))
      if (p.requires_grad()) mine.push_back(p.unsafeGetTensorImpl());
    if (mine.empty()) {
      unit_of_layer_.push_back(-1);
      continue;
    }
    TORCH_CHECK_VALUE(unit < shards.unit_count(), "ShardedSequential: layer '", item.key(), "' has parameters but "
                      "the optimizer has only ", shards.unit_count(), " units; build it from sequential_units(layers)");
    std::vector<const c10::TensorImpl*> theirs;
    for (const at::Tensor& t : shards.unit_tensors(unit)) theirs.push_back(t.unsafeGetTensorImpl());
    std::sort(mine.begin(), mine.end());
    std::sort(theirs.begin(), theirs.end());
    TORCH_CHECK_VALUE(mine == theirs, "ShardedSequential: layer '", item.key(), "' does not hold the parameters of "
                      "the optimizer's unit ", unit, "; build the optimizer from sequential_units(layers)");
    unit_of_layer_.push_back(static_cast<int64_t>(unit++));
  }
  TORCH_CHECK_VALUE(unit == shards.unit_count(), "ShardedSequential: the optimizer has ", shards.unit_count(),
                    " units, the layers ", unit, "; build it from sequential_units(layers)");
}

at::Tensor ShardedSequentialImpl::forward(at::Tensor x) {
  ZeroShards* live = ZeroShards::find_live(shards_key_);
  TORCH_CHECK_VALUE(live != nullptr, "ShardedSequential: its ZeroOptimizer was destroyed; build a new optimizer and "
                    "ShardedSequential together");
  ZeroShards& shards = *live;
  // A layer added or removed after the wrap would run unsharded (or take another's unit): named, not run.
  TORCH_CHECK_VALUE(layers->size() == unit_of_layer_.size(), "ShardedSequential: the Sequential has ", layers->size(),
                    " layers, ", unit_of_layer_.size(), " when it was wrapped; layers cannot be added or removed "
                    "after the wrap (build the optimizer and ShardedSequential again from the new Sequential)");
  size_t i = 0;
  for (auto& layer : *layers) {  // AnyModule: any layer taking and returning one tensor
    const int64_t unit = unit_of_layer_.at(i++);
    if (unit < 0) {
      x = layer.forward(x);
      continue;
    }
    shards.unit_pre_forward(static_cast<size_t>(unit));
    x = layer.forward(x);
    shards.unit_post_forward(static_cast<size_t>(unit));
    // A recomputation inside backward (a checkpointed layer) needs no second gathering node.
    if (c10::GradMode::is_enabled() && x.requires_grad() && torch::autograd::get_current_graph_task_id() == -1)
      x = GatherForBackward::apply(x, shards.live_key(), unit);
  }
  return x;
}

}  // namespace gpuops::optim
