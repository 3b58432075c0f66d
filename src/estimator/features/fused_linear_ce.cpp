// Liger's fused linear cross-entropy (LossKind::FusedLinearCe): no logits are kept; the gradients are made in the
// forward, chunk by chunk.
#include <algorithm>

#include "gpuops/errors.h"
#include "gpuops/estimator/activations.h"
#include "setup_feature.h"

namespace gpuops::estimator {
namespace {

using C = CheckedInt;

class FusedLinearCeFeature final : public SetupFeature {
 public:
  void validate(const TrainingSetup& s, const ModelSpec& m) const override {
    if (!on(s)) return;
    GPUOPS_CHECK_ARG(has_lm_head(m), "loss {} needs a model with a "
                     "language-model head; model '{}' has none; accepted: standard", loss_to_string(s), m.name);
  }
  bool on(const TrainingSetup& s) const override { return s.loss == LossKind::FusedLinearCe; }
  // Saved: the input gradient (final-norm dtype), the LM-head weight gradient (full fine-tune), the fp32
  // per-token loss, the labels and the loss (no logits, so no soft-capped copy either).
  std::optional<int64_t> loss_saved(const StepContext& c) const override {
    const ModelSpec& m = c.model;
    const TrainingSetup& s = c.setup;
    const C N = C(s.micro_batch) * s.seq_len;
    const C weight_grad = s.lora.rank == 0 ? C(m.vocab_size) * m.hidden_size * (runs_in_16_bits(s) ? 2 : 4) : C(0);
    return (N * m.hidden_size * residual_stream_bytes(s) + weight_grad + N * 4 + N * 8 + 4).get();
  }
  // The transient is one chunk of logits in the compute dtype, chunk = next_pow2(ceil(N / ceil(V / h))) tokens.
  std::optional<int64_t> loss_moment(const StepContext& c, int64_t saved) const override {
    const ModelSpec& m = c.model;
    const TrainingSetup& s = c.setup;
    const C N = C(s.micro_batch) * s.seq_len;
    const int64_t per_chunk_growth = ceil_div(m.vocab_size, m.hidden_size);
    int64_t chunk = 1;
    while (chunk < ceil_div(N.get(), per_chunk_growth)) chunk *= 2;
    return (C(saved) + C(std::min(chunk, N.get())) * m.vocab_size * compute_dtype_bytes(s.precision)).get();
  }
};

}  // namespace

const SetupFeature& fused_linear_ce_feature() {
  static const FusedLinearCeFeature feature;
  return feature;
}

}  // namespace gpuops::estimator
