// gpuops::checkpoint (checkpoint.h): a custom autograd Node that recomputes its segment in the backward.
#include "gpuops/checkpoint.h"

#include <algorithm>
#include <optional>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/saved_variable.h>

#include "../common/rng_state.h"
#include "gpuops/autocast.h"
#include "gpuops/memory_budget.h"

namespace gpuops {
namespace {

using torch::autograd::variable_list;

using detail::RngState;

// The autocast state of one device type.
struct AutocastState {
  c10::DeviceType device;
  bool enabled;
  c10::ScalarType dtype;
  bool cache;
  static AutocastState capture(c10::DeviceType device) {
    return {device, at::autocast::is_autocast_enabled(device), at::autocast::get_autocast_dtype(device),
            at::autocast::is_autocast_cache_enabled()};
  }
};

// Copies buffers the segment updates in place and writes them back when it goes out of scope.
class BufferRestorer {
 public:
  explicit BufferRestorer(const std::vector<at::Tensor>& buffers) : buffers_(buffers) {
    for (const auto& b : buffers) copies_.push_back(b.detach().clone());
  }
  ~BufferRestorer() {
    c10::NoGradGuard no_grad;
    for (size_t i = 0; i < buffers_.size(); ++i) {
      try {
        buffers_[i].copy_(copies_[i]);
      } catch (...) {  // same shape and dtype as when copied: cannot fail short of a device error
      }
    }
  }
  BufferRestorer(const BufferRestorer&) = delete;
  BufferRestorer& operator=(const BufferRestorer&) = delete;

 private:
  const std::vector<at::Tensor>& buffers_;
  std::vector<at::Tensor> copies_;
};

// An input kept in host memory (CheckpointOptions::offload_inputs): its values, where it came from, and its
// version counter (shared with the tensor, not its storage) so that a change in place is still caught.
struct HostInput {
  at::Tensor values;
  c10::Device device = c10::kCPU;
  c10::VariableVersion version;  // (disabled until of() shares the tensor's)
  uint32_t saved_version = 0;

  static HostInput of(const at::Tensor& x) {
    HostInput h;
    if (!x.defined()) return h;
    {
      UnbudgetedScope host;  // host memory: not the device's (a CPU MemoryBudget stands for the device)
      h.values = at::empty(x.sizes(), x.options().device(at::kCPU).pinned_memory(x.is_cuda()));
    }
    h.values.copy_(x.detach(), /*non_blocking=*/x.is_cuda());
    h.device = x.device();
    h.version = x.unsafeGetTensorImpl()->version_counter();
    h.saved_version = h.version.current_version();
    return h;
  }
  at::Tensor back() const {
    if (!values.defined()) return at::Tensor();
    TORCH_CHECK(version.current_version() == saved_version, "gpuops::checkpoint: one of the variables needed for "
                "gradient computation has been modified by an inplace operation: a checkpointed segment's input "
                "(kept in host memory, offload_inputs) is at version ", version.current_version(), "; expected "
                "version ", saved_version, " instead");
    return values.to(device, /*non_blocking=*/device.is_cuda());
  }
};

struct CheckpointBackward : public torch::autograd::Node {
  SegmentFn fn;
  std::vector<torch::autograd::SavedVariable> inputs;
  std::vector<HostInput> host_inputs;  // offload_inputs: in place of `inputs`
  std::vector<bool> input_needs_grad;
  std::vector<int> slot_of_output;  // node input number of each output, -1 for non-differentiable ones
  CheckpointOptions options;
  RngState rng;
  std::vector<AutocastState> autocast;

  std::string name() const override { return "gpuops::CheckpointBackward"; }

  variable_list apply(variable_list&& grads) override {
    // release_variables() ran: the inputs are gone, as torch's saved tensors are after a backward.
    TORCH_CHECK(static_cast<bool>(fn), "gpuops::checkpoint: Trying to backward through the graph a second time; the "
                "segment's saved inputs were freed by the first backward. Specify retain_graph=True if you need to "
                "backward through the graph a second time");
    // A RuntimeError naming torch's phrase, as torch's reentrant checkpoint raises (its tests match on it).
    TORCH_CHECK(torch::autograd::Engine::get_default_engine().is_checkpoint_valid(),
                "gpuops::checkpoint: grad() with `inputs` (or backward(inputs=...)) cannot reach into a checkpointed "
                "segment: the reentrant recomputation accumulates into .grad, as torch.utils.checkpoint is "
                "incompatible with .grad() when use_reentrant=True. Call backward() without `inputs`, or (Python) "
                "checkpoint with use_reentrant=False");
    std::vector<at::Tensor> leaves;
    for (size_t i = 0; i < input_needs_grad.size(); ++i) {
      at::Tensor x = options.offload_inputs ? host_inputs[i].back()
                                            : inputs[i].unpack(shared_from_this());  // throws if modified in place
      if (x.defined()) x = x.detach();  // an undefined input goes back to fn as it came
      if (input_needs_grad[i]) x.requires_grad_(true);
      leaves.push_back(x);
    }
    // The buffers go back after the backward (the recomputation saved them at their current version), and
    // also when the recomputation or its backward throws: the step changes them once, or not at all.
    const BufferRestorer buffers(options.buffers);
    std::vector<at::Tensor> outputs;
    {
      std::optional<detail::RngStateGuard> keep_rng;  // the caller's RNG state back however fn ends
      if (options.preserve_rng_state) {
        keep_rng.emplace();
        rng.restore();
      }
      c10::AutoGradMode enable_grad(true);
      std::vector<std::unique_ptr<amp::AutocastGuard>> guards;
      for (const auto& a : autocast)
        guards.push_back(std::make_unique<amp::AutocastGuard>(a.device, a.dtype, a.enabled, a.cache));
      outputs = fn(leaves);
    }
    TORCH_CHECK(outputs.size() == slot_of_output.size(), "gpuops::checkpoint: the recomputation returned ",
                outputs.size(), " outputs, the forward ", slot_of_output.size(), "; the segment must be deterministic "
                "in its structure");
    // As torch's reentrant checkpoint: the forward ran without grad, so it could not know; now it does.
    const bool any_output_needs_grad = [&] {
      for (size_t i = 0; i < outputs.size(); ++i)
        if (slot_of_output[i] >= 0 && outputs[i].defined() && outputs[i].requires_grad()) return true;
      return false;
    }();
    TORCH_CHECK(any_output_needs_grad, "gpuops::checkpoint: none of output has requires_grad=True, this checkpoint() "
                "is not necessary: no output of the segment depends on an input or parameter that requires grad; "
                "call the function without checkpointing it");
    variable_list roots, root_grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      const int slot = slot_of_output[i];
      if (slot >= 0 && grads[slot].defined() && outputs[i].requires_grad()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grads[slot]);
      }
    }
    if (!roots.empty()) torch::autograd::backward(roots, root_grads);  // parameters' .grad accumulate here
    variable_list result;
    for (size_t i = 0; i < leaves.size(); ++i) result.push_back(input_needs_grad[i] ? leaves[i].grad() : at::Tensor());
    return result;
  }

  void release_variables() override {
    inputs.clear();
    host_inputs.clear();
    fn = nullptr;
  }
};

}  // namespace

std::vector<at::Tensor> checkpoint(const SegmentFn& fn, const std::vector<at::Tensor>& inputs,
                                   const CheckpointOptions& options) {
  TORCH_CHECK_VALUE(static_cast<bool>(fn), "gpuops::checkpoint: fn is an empty function");
  for (size_t i = 0; i < options.buffers.size(); ++i)  // checked now: they are copied only in the backward
    TORCH_CHECK_VALUE(options.buffers[i].defined(), "gpuops::checkpoint: options.buffers[", i, "] is undefined");
  if (!c10::GradMode::is_enabled()) return fn(inputs);
  const bool any_needs_grad =
      std::any_of(inputs.begin(), inputs.end(), [](const at::Tensor& t) { return t.defined() && t.requires_grad(); });
  if (!any_needs_grad) {  // as torch's reentrant checkpoint: a warning, and outputs that need no grad
    TORCH_WARN("gpuops::checkpoint: None of the inputs have requires_grad=True. Gradients will be None: the "
               "parameters inside the segment get no gradient; make an input require grad (x.requires_grad_()) "
               "or do not checkpoint this segment");
    c10::NoGradGuard no_grad;
    return fn(inputs);
  }
  auto node = std::shared_ptr<CheckpointBackward>(new CheckpointBackward(), torch::autograd::deleteNode);
  node->fn = fn;
  node->options = options;
  if (options.preserve_rng_state) node->rng = RngState::capture();
  node->autocast = {AutocastState::capture(c10::kCPU), AutocastState::capture(c10::kCUDA)};
  std::vector<at::Tensor> outputs;
  {
    c10::NoGradGuard no_grad;
    outputs = fn(inputs);
  }
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  for (const auto& x : inputs) {
    if (options.offload_inputs) {
      node->host_inputs.push_back(HostInput::of(x));
    } else {
      node->inputs.emplace_back(x, /*is_output=*/false);
    }
    node->input_needs_grad.push_back(x.defined() && x.requires_grad());
  }
  for (auto& out : outputs) {
    if (!out.defined() || !at::isFloatingType(out.scalar_type())) {
      node->slot_of_output.push_back(-1);
      continue;
    }
    // An input passed through (even one that needs no grad) gets a copy: the node's edge must not go onto
    // the caller's tensor.
    const bool is_input = std::any_of(inputs.begin(), inputs.end(), [&](const at::Tensor& x) { return x.is_same(out); });
    if (!out.is_leaf() || out.requires_grad() || is_input) out = out.detach().clone();
    node->slot_of_output.push_back(static_cast<int>(node->num_inputs()));
    torch::autograd::create_gradient_edge(out, node);
  }
  return outputs;
}

at::Tensor checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& input,
                      const CheckpointOptions& options) {
  TORCH_CHECK_VALUE(static_cast<bool>(fn), "gpuops::checkpoint: fn is an empty function");
  return checkpoint([fn](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{fn(in[0])}; },
                    {input}, options)[0];
}

}  // namespace gpuops
