// A chunked cross-entropy (LossKind::Chunked: torchtune's CEWithChunkedOutputLoss, litgpt's chunked_cross_entropy):
// the logits in loss_chunks token chunks. Its forward saves what the standard loss saves (every chunk's
// log-softmax, fp32 unless the loss does not upcast); the loss moment differs.
#include <algorithm>

#include "gpuops/errors.h"
#include "setup_feature.h"

namespace gpuops::estimator {
namespace {

using C = CheckedInt;

class ChunkedLossFeature final : public SetupFeature {
 public:
  void validate(const TrainingSetup& s, const ModelSpec& m) const override {
    if (!on(s)) return;
    GPUOPS_CHECK_ARG(s.loss_chunks >= 1, "loss chunked:{} is not accepted; accepted: chunked:C with C >= 1",
                     s.loss_chunks);
    GPUOPS_CHECK_ARG(has_lm_head(m), "loss {} needs a model with a "
                     "language-model head; model '{}' has none; accepted: standard", loss_to_string(s), m.name);
  }
  bool on(const TrainingSetup& s) const override { return s.loss == LossKind::Chunked; }
  // Eager: the larger of the end of the loss's forward (every chunk's logits in the compute dtype still held by
  // the caller, the last chunk's fp32 upcast) and the first chunk's backward (two fp32 gradients of one chunk).
  // Compiled (torchtune compiles each chunk's loss): the saved compute-dtype logits, then one chunk's gradient.
  std::optional<int64_t> loss_moment(const StepContext& c, int64_t saved) const override {
    const TrainingSetup& s = c.setup;
    const C N = C(s.micro_batch) * s.seq_len, V = c.model.vocab_size;
    const int64_t e = compute_dtype_bytes(s.precision);
    const C chunk = ceil_div(N.get(), s.loss_chunks);
    if (s.compile) return (C(saved) + chunk * V * e).get();
    const int64_t l = loss_logit_bytes(s);
    const C backward = C(saved) - N * 8 + 2 * chunk * V * l;
    const C forward = C(saved) + N * V * e + (e == l ? C(0) : chunk * V * l);
    return std::max(backward.get(), forward.get());
  }
};

}  // namespace

const SetupFeature& chunked_loss_feature() {
  static const ChunkedLossFeature feature;
  return feature;
}

}  // namespace gpuops::estimator
