// Held logits (TrainingSetup::held_logits): the logits the training loop keeps alive through the backward and
// the step (`out = model(**batch); out.loss.backward()`), until the next forward replaces them.
#include <fmt/format.h>

#include "gpuops/errors.h"
#include "gpuops/estimator/step_phases.h"
#include "setup_feature.h"

namespace gpuops::estimator {
namespace {

class HeldLogitsFeature final : public SetupFeature {
 public:
  void validate(const TrainingSetup& s, const ModelSpec& m) const override {
    GPUOPS_CHECK_ARG(s.held_logits == HeldLogits::None || has_lm_head(m),
                     "held-logits {} needs a model with a language-model head; model '{}' has none; accepted: none",
                     to_string(s.held_logits), m.name);
  }
  bool on(const TrainingSetup& s) const override { return s.held_logits != HeldLogits::None; }
  // Alive at every moment of the step.
  void moments(const StepContext& c, const MomentTerms&, Moments& moments) const override {
    const int64_t held = held_logits_bytes(c.model, c.setup);
    for (MemoryBreakdown& p : moments) p.logits = (CheckedInt(p.logits) + held).get();
  }
  // From the first forward on, one set is always alive.
  int64_t held_through_steps(const StepContext& c) const override { return held_logits_bytes(c.model, c.setup); }
};

}  // namespace

int64_t held_logits_bytes(const ModelSpec& m, const TrainingSetup& s) {
  if (s.held_logits == HeldLogits::None || !has_lm_head(m)) return 0;
  const int64_t e = s.held_logits == HeldLogits::Fp32 ? 4 : compute_dtype_bytes(s.precision);
  return (CheckedInt(s.micro_batch) * s.seq_len * m.vocab_size * e).get();
}

const SetupFeature& held_logits_feature() {
  static const HeldLogitsFeature feature;
  return feature;
}

}  // namespace gpuops::estimator
