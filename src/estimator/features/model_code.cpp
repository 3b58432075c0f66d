// The model's code (TrainingSetup::model_code): LitGPT's own model projects q, k and v with one fused linear on
// every architecture and expands grouped k and v to every head as copies (activations.cpp, fused_qkv_extra).
#include <fmt/format.h>

#include "gpuops/errors.h"
#include "setup_feature.h"

namespace gpuops::estimator {
namespace {

class ModelCodeFeature final : public SetupFeature {
 public:
  void validate(const TrainingSetup& s, const ModelSpec& m) const override {
    GPUOPS_CHECK_ARG(s.model_code == ModelCode::HuggingFace ||
                         (m.family == ModelFamily::Decoder && !m.learned_positions && m.kv_lora_rank == 0),
                     "model-code {} runs decoders with RoPE and q/k/v projections; model '{}' is not one; accepted: hf",
                     to_string(s.model_code), m.name);
  }
  bool on(const TrainingSetup& s) const override { return s.model_code == ModelCode::LitGpt; }
  void run_model(ModelSpec& m) const override {
    m.fused_qkv = true;
    m.kv_expanded_copies = true;
  }
};

}  // namespace

const SetupFeature& model_code_feature() {
  static const ModelCodeFeature feature;
  return feature;
}

}  // namespace gpuops::estimator
