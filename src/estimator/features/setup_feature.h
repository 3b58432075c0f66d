#pragma once
// A setup feature of the estimator: all that one TrainingSetup option changes in an estimate, in one unit
// (src/estimator/features/<name>.cpp). The core walks a step in order (the model as run, its persistent state,
// the forward, the four moments, the allocator's trace) and at each stage lets the features the setup turns on
// contribute, in registry order (features.cpp), a later one adjusting what an earlier one made. The core itself
// reads no option that a feature owns. Private to src/estimator.

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "../forward_ops.h"
#include "gpuops/estimator/activations.h"
#include "gpuops/estimator/device_profile.h"
#include "gpuops/estimator/memory_breakdown.h"
#include "gpuops/estimator/model_spec.h"
#include "gpuops/estimator/param_tensors.h"
#include "gpuops/estimator/training_setup.h"

namespace gpuops::estimator {

/// What every stage of the walk is computed from (the model as run).
struct StepContext {
  const ModelSpec& model;
  const TrainingSetup& setup;
  const DeviceProfile& device;
};

/// The core's figures of the backward that a feature's moments build on.
struct MomentTerms {
  const ForwardSaved& forward;
  int64_t gradients_so_far = 0;  ///< gradients alive before the backward made any (accumulated, kept, or none)
  int64_t head_gradient = 0;     ///< the LM head's weight gradient (full fine-tune with an LM head), else 0
  int64_t backward_extras = 0;   ///< transients of every backward moment (a quantised base's dequantised weight)
  int64_t hidden_gradient = 0;   ///< one hidden-state gradient, N x h in the trainable dtype
};

/// One breakdown per StepPhase, in enum order.
using Moments = std::vector<MemoryBreakdown>;
inline MemoryBreakdown& moment(Moments& moments, StepPhase phase) { return moments[static_cast<size_t>(phase)]; }

class SetupFeature {
 public:
  virtual ~SetupFeature() = default;
  /// Checks of this feature's options and their consistency with the model and the rest of the setup; called
  /// for every feature, on or off (an option given without its feature is refused here). ArgumentError.
  virtual void validate(const TrainingSetup&, const ModelSpec&) const {}
  /// True when `setup` turns the feature on; only then does it contribute below.
  virtual bool on(const TrainingSetup& setup) const = 0;

  // ---- 1. The model as the setup runs it.
  virtual void run_model(ModelSpec&) const {}
  // ---- 2. The persistent state.
  /// The tensors that get gradients and optimizer states, where this feature decides them (LoRA's adapters);
  ///    nullopt: the model's own.
  virtual std::optional<std::vector<ParamTensor>> trainable_tensors(const ModelSpec&, const TrainingSetup&) const {
    return std::nullopt;
  }
  /// The model's own weights are frozen: no LM-head gradient, no tied embedding's second gradient, and the
  /// allocator's trace lays the weights over the model's tensors.
  virtual bool freezes_model() const { return false; }
  /// The residual stream runs in 16 bits under mixed precision (a 16-bit frozen base), not only in pure bf16.
  virtual bool stream_in_16_bits(const TrainingSetup&) const { return false; }
  /// Transients of every backward moment (a quantised base weight dequantised for its matmul).
  virtual int64_t backward_transients(const ModelSpec&, const TrainingSetup&) const { return 0; }
  /// A sharding layout's local share of the trainable elements from ZeRO stage `from_stage` on, and of the frozen
  /// (LoRA base) bytes; nullopt: the core's flat partitions (zero_shard).
  virtual std::optional<int64_t> local_trainable_elements(const ModelSpec&, const TrainingSetup&, int) const {
    return std::nullopt;
  }
  virtual std::optional<int64_t> local_frozen_bytes(const ModelSpec&, const TrainingSetup&) const {
    return std::nullopt;
  }
  /// Persistent state on one device: sizes of the weights, gradients, master weights and states.
  virtual void persistent(const StepContext&, MemoryBreakdown&) const {}
  /// Where that state lives (moves bytes to host_memory), after every feature's sizes.
  virtual void place(const StepContext&, MemoryBreakdown&) const {}
  /// Gradients (or their shards) exist before the backward makes them: from construction or kept between steps.
  virtual bool gradients_before_backward() const { return false; }
  // ---- 3. The forward.
  /// What the forward's ops save, where this feature changes it: a model wrapping `inner` (the eager one, or an
  /// earlier feature's); nullptr: unchanged.
  virtual std::unique_ptr<ForwardOps> forward_ops(const TrainingSetup&, const ForwardOps& /*inner*/) const {
    return nullptr;
  }
  /// Whether the forward checkpoints block `layer` of `num_layers` (it then keeps only its input).
  virtual bool checkpoints_layer(const TrainingSetup&, int64_t /*layer*/, int64_t /*num_layers*/) const {
    return false;
  }
  /// What the feature adds to the forward's saved bytes, once the core has counted the blocks and the head.
  virtual void forward(const ModelSpec&, const TrainingSetup&, const Shape&, ForwardSaved&) const {}
  /// The loss's saved bytes where this feature computes the loss (nullopt: the core's cross-entropy), and the
  /// head's bytes at the loss moment given them.
  virtual std::optional<int64_t> loss_saved(const StepContext&) const { return std::nullopt; }
  virtual std::optional<int64_t> loss_moment(const StepContext&, int64_t /*saved*/) const { return std::nullopt; }
  // ---- 4. The step's moments.
  /// Bytes the optimizer step allocates for itself, where this feature decides them (a later feature's answer
  /// replaces an earlier one's); nullopt: not this feature's to say.
  virtual std::optional<int64_t> step_temporaries(const StepContext&) const { return std::nullopt; }
  /// Unsharded parameters and gradients (ZeRO-3 layouts) alive at a backward moment, added to its temporaries.
  virtual int64_t gathered_bytes(const ModelSpec&, const TrainingSetup&, StepPhase) const { return 0; }
  /// Of gathered_bytes, what stays gathered from the forward's start to the backward's end (FSDP1's root unit): the
  ///    allocator's trace holds it once rather than as each block's transient.
  virtual int64_t gathered_through_backward(const ModelSpec&, const TrainingSetup&) const { return 0; }
  /// True when the gathers and the gradient shards are made on side streams of their own (FSDP1's unshard and
  /// post-backward streams), whose cached blocks the default stream cannot reuse (the allocator's trace).
  virtual bool gathers_on_side_streams(const TrainingSetup&) const { return false; }
  /// Anything else at the moments, once the core has built all four.
  virtual void moments(const StepContext&, const MomentTerms&, Moments&) const {}
  // ---- 5. The allocator's trace.
  /// Bytes allocated before the first step that stay alive through every step (the allocator's trace).
  virtual int64_t held_through_steps(const StepContext&) const { return 0; }
};

/// Every feature, in the order their contributions apply.
const std::vector<const SetupFeature*>& all_features();
/// The features `setup` turns on, in that order.
std::vector<const SetupFeature*> features_of(const TrainingSetup& setup);
/// The trainable tensors a feature of `setup` decides (the first that does); nullopt: the model's own.
std::optional<std::vector<ParamTensor>> feature_trainable_tensors(const ModelSpec& model, const TrainingSetup& setup);
/// True when a feature of `setup` freezes the model's own weights (LoRA).
bool model_frozen(const TrainingSetup& setup);
/// Runs every feature's validate.
void validate_features(const TrainingSetup& setup, const ModelSpec& model);

/// Bytes of one trainable weight or gradient element: 2 when the model runs in 16 bits, else 4.
inline int64_t trainable_element_bytes(const TrainingSetup& s) { return runs_in_16_bits(s) ? 2 : 4; }

// The units (features/<name>.cpp), each one object.
const SetupFeature& adafactor_feature();
const SetupFeature& gpuops_zero12_feature();
const SetupFeature& zero3_flat_feature();
const SetupFeature& fsdp1_orig_params_feature();
/// FSDP1 with use_orig_params under LoRA on the blocks: their frozen weights require grad (fsdp1_orig_params.cpp).
bool fsdp1_blocks_require_grad(const TrainingSetup& setup);
/// The gradients that gives: one unit's unsharded gradient in its backward, and every block's kept shard.
struct Fsdp1OrigGradients {
  int64_t unit = 0, kept = 0;
};
Fsdp1OrigGradients fsdp1_orig_gradients(const ModelSpec& model, const TrainingSetup& setup);
/// Bytes of one element of a flat ZeRO-3 / FSDP1 parameter: the trainable dtype, or a LoRA base's (16 bits for a
/// quantised one, which is gathered dequantised).
int64_t flat_parameter_element_bytes(const TrainingSetup& setup);
const SetupFeature& fsdp2_feature();
const SetupFeature& gpuops_stage3_feature();
const SetupFeature& offload_feature();
const SetupFeature& paged_optimizer_feature();
const SetupFeature& gpuops_adam8_feature();
const SetupFeature& held_logits_feature();
const SetupFeature& checkpointing_feature();
const SetupFeature& compile_feature();
const SetupFeature& lora_feature();
const SetupFeature& chunked_loss_feature();
const SetupFeature& fused_linear_ce_feature();
const SetupFeature& model_code_feature();

}  // namespace gpuops::estimator
