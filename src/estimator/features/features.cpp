// The registry of setup features (setup_feature.h): the one list of units, in the order they apply. A new
// setup option is a new unit here plus its CLI option and Python keyword.
#include "setup_feature.h"

#include <algorithm>

namespace gpuops::estimator {

const std::vector<const SetupFeature*>& all_features() {
  // Order matters where two units touch one figure: compile's model of the ops before LoRA's, which wraps it;
  // the states' sizes (Adafactor) before their placement (offload, paging), whose step temporaries then replace
  // Adafactor's.
  static const std::vector<const SetupFeature*> features = {
      &model_code_feature(),  &compile_feature(), &lora_feature(), &checkpointing_feature(), &chunked_loss_feature(), &fused_linear_ce_feature(),
      &zero3_flat_feature(),  &fsdp1_orig_params_feature(), &fsdp2_feature(),           &adafactor_feature(),       &gpuops_adam8_feature(),
      &gpuops_zero12_feature(), &gpuops_stage3_feature(), &offload_feature(), &paged_optimizer_feature(),
      &held_logits_feature(),
  };
  return features;
}

std::vector<const SetupFeature*> features_of(const TrainingSetup& setup) {
  std::vector<const SetupFeature*> on;
  for (const SetupFeature* f : all_features())
    if (f->on(setup)) on.push_back(f);
  return on;
}

std::optional<std::vector<ParamTensor>> feature_trainable_tensors(const ModelSpec& model, const TrainingSetup& setup) {
  for (const SetupFeature* f : features_of(setup))
    if (auto own = f->trainable_tensors(model, setup)) return own;
  return std::nullopt;
}

bool model_frozen(const TrainingSetup& setup) {
  const std::vector<const SetupFeature*> on = features_of(setup);
  return std::any_of(on.begin(), on.end(), [](const SetupFeature* f) { return f->freezes_model(); });
}

void validate_features(const TrainingSetup& setup, const ModelSpec& model) {
  for (const SetupFeature* f : all_features()) f->validate(setup, model);
}

bool gradients_alive_in_forward(const TrainingSetup& s) {
  if (s.grad_accum > 1 || !s.grads_set_to_none) return true;
  for (const SetupFeature* f : features_of(s))
    if (f->gradients_before_backward()) return true;
  return false;
}

}  // namespace gpuops::estimator
