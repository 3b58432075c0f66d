// The model's code (TrainingSetup::model_code): LitGPT's own model projects q, k and v with one fused linear on
// every architecture and expands grouped k and v to every head as copies (activations.cpp, fused_qkv_extra).
// Its 4-bit quantisation (Lightning's BitsandbytesPrecision, lightning 2.1-2.3) quantises every weight from
// float16 (_Linear4bit._quantize_weight: weight.to(dtype=torch.half)), so bitsandbytes dequantises to float16 and
// its MatMul4Bit casts that to a bf16 input's dtype: `F.dequantize_4bit(B, state).to(A.dtype)`, both copies alive
// at the cast. (int8's MatMul8bitLt dequantises straight to the input's dtype.) Lightning replaces every
// nn.Linear, the LM head's too: quantize_lm_head, which the user gives.
#include <fmt/format.h>

#include "gpuops/errors.h"
#include "gpuops/estimator/estimate.h"
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
  // Beside the float16 dequantised weight (LoRA's unit counts it), its cast to a bf16 or fp32 compute dtype.
  int64_t backward_transients(const ModelSpec& m, const TrainingSetup& s) const override {
    const bool four_bit = s.lora.base == BaseWeightDtype::Nf4 || s.lora.base == BaseWeightDtype::Nf4NoDq;
    if (!four_bit || s.precision == Precision::Fp16Mixed) return 0;
    return (CheckedInt(compute_dtype_bytes(s.precision)) * largest_quantised_weight_elements(m, s)).get();
  }
};

}  // namespace

const SetupFeature& model_code_feature() {
  static const ModelCodeFeature feature;
  return feature;
}

}  // namespace gpuops::estimator
