// torch.compile (TrainingSetup::compile): inductor's min-cut partition of the joint graph saves less than the
// eager ops (docs/estimator.md, "Checkpointing policies, chunked loss, LoRA dropout, torch.compile"; measured
// with SDPA, so eager attention is refused).
#include <memory>

#include "gpuops/errors.h"
#include "setup_feature.h"

namespace gpuops::estimator {
namespace {

using C = CheckedInt;

// The eager model with inductor's terms: its block and final norm use this norm (virtual calls).
class CompiledOps final : public ForwardOps {
 public:
  // Inductor: a norm's input, one output (its 16-bit cast under autocast, shared by readers), rstd.
  C norm(const ModelSpec&, const Shape& x, int64_t) const override {
    const C Nh = x.N * x.h;
    switch (x.mode) {
      case Numerics::Fp32: return 2 * Nh * 4 + x.N * 4;
      case Numerics::Autocast: return Nh * 4 + Nh * 2 + x.N * 4;
      case Numerics::Half: return 2 * Nh * 2 + x.N * 4;
    }
    return 0;
  }
  // One shared CPU mask (shared_by_blocks), and no view keeping a fused q|k|v output alive.
  C attention(const ModelSpec& m, const TrainingSetup& t, const Shape& x) const override {
    return attention_bytes(m, t, x, false, false);
  }
  // Inductor recomputes silu / GELU.
  C mlp(const ModelSpec& m, const Shape& x) const override {
    return (m.mlp == MlpKind::SwiGlu ? 3 : 2) * x.N * x.i * x.e;
  }
  C rope_tables(const Shape& x) const override { return 2 * x.s * x.d; }  // fp32 frequencies
  C shared_by_blocks(const TrainingSetup& t, const Shape& x, int64_t checkpointed) const override {
    return t.attention == AttentionKind::Sdpa && x.cpu && checkpointed < x.L.get() ? x.b * x.s * x.s * x.e : C(0);
  }
  // Under autocast the final norm keeps its input and output as 16-bit only (measured).
  C final_norm(const ModelSpec& m, const Shape& x) const override {
    return x.mode == Numerics::Autocast ? 2 * x.N * x.h * 2 + x.N * 4 : norm(m, x, 1);
  }
  // The logits in the compute dtype, two fp32 values per row and labels padded by one per sequence.
  C loss(const Shape& x, int64_t) const override { return x.N * x.V * x.e + 2 * x.N * 4 + x.b * (x.s + 1) * 8 + 4; }
};

class CompileFeature final : public SetupFeature {
 public:
  void validate(const TrainingSetup& s, const ModelSpec&) const override {
    GPUOPS_CHECK_ARG(!s.compile || s.attention != AttentionKind::Eager,
                     "compile with attention eager is not modelled (inductor's partition was measured with sdpa); "
                     "accepted with attention sdpa or flash");
  }
  bool on(const TrainingSetup& s) const override { return s.compile; }
  // The first unit to change the ops (features.cpp): `inner` is the eager model, which this one refines.
  std::unique_ptr<ForwardOps> forward_ops(const TrainingSetup&, const ForwardOps&) const override {
    return std::make_unique<CompiledOps>();
  }
};

}  // namespace

const SetupFeature& compile_feature() {
  static const CompileFeature feature;
  return feature;
}

}  // namespace gpuops::estimator
