// Activation checkpointing (TrainingSetup::checkpoint). Full and every:K: reentrant, as Hugging Face's
// gradient_checkpointing_enable, every k-th block from the first; a checkpointed block keeps its input hidden
// states and the CPU RNG state (the core counts those), and its autocast weight copies are not made (its
// forward runs without grad). Selective: torch.utils.checkpoint, non-reentrant, with torchtitan's op policy on
// every block: as a checkpointed block, plus the policy's cache.
#include <algorithm>
#include <limits>

#include "gpuops/errors.h"
#include "setup_feature.h"

namespace gpuops::estimator {
namespace {

using C = CheckedInt;

// What torchtitan's op-level selective policy keeps of one block (MUST_SAVE outputs, held by the
// checkpoint until its recomputation pops them): every odd aten.mm of the block in call order (q, k, v, o,
// then gate, up, down; a LoRA target's A and B matmuls follow its base; biased linears dispatch to addmm and
// quantised bases to bitsandbytes, which the list does not name), and on CUDA SDPA's output and fp32
// log-sum-exp (the CPU's _scaled_dot_product_flash_attention_for_cpu, eager's bmm/softmax are not listed).
C selective_cache_bytes(const ModelSpec& m, const TrainingSetup& t, const Shape& x) {
  const bool quantised = t.lora.rank > 0 && (t.lora.base == BaseWeightDtype::Int8 || t.lora.base == BaseWeightDtype::Nf4);
  C bytes = 0;
  int64_t count = 0;
  const auto mm = [&](int64_t out_features) {
    if (++count % 2 == 1) bytes += x.N * out_features * x.e;
  };
  for (const auto& p : projection_names(m)) {
    const LinearShape l = projection_shape(m, p);
    if (!l.bias && !quantised) mm(l.out_features);
    if (t.lora.rank > 0 && std::find(t.lora.targets.begin(), t.lora.targets.end(), p) != t.lora.targets.end()) {
      mm(t.lora.rank);
      mm(l.out_features);
    }
  }
  if (t.attention == AttentionKind::Sdpa && !x.cpu) bytes += x.Nq() * x.e + x.b * x.a * x.s * 4;
  return bytes;
}


class CheckpointingFeature final : public SetupFeature {
 public:
  void validate(const TrainingSetup& s, const ModelSpec& m) const override {
    if (s.checkpoint != CheckpointKind::EveryK) return;
    const int64_t max_k = m.family == ModelFamily::ParamsOnly ? std::numeric_limits<int64_t>::max() : m.num_layers;
    GPUOPS_CHECK_ARG(s.checkpoint_every_k >= 1 && s.checkpoint_every_k <= max_k,
                     "checkpointing every:{} is not accepted for model '{}'; accepted: every:K with 1 <= K <= {} "
                     "(num_layers)", s.checkpoint_every_k, m.name, m.num_layers);
  }
  bool on(const TrainingSetup& s) const override { return s.checkpoint != CheckpointKind::None; }
  bool checkpoints_layer(const TrainingSetup& s, int64_t layer, int64_t) const override {
    return s.checkpoint != CheckpointKind::EveryK || layer % s.checkpoint_every_k == 0;
  }
  void forward(const ModelSpec& m, const TrainingSetup& t, const Shape& x, ForwardSaved& f) const override {
    if (t.checkpoint == CheckpointKind::Selective) {  // held by every block's checkpoint until its recomputation
      const C cache = selective_cache_bytes(m, t, x);
      f.last_block_cache = cache.get();
      f.layers = (C(f.layers) + cache * m.num_layers).get();
    }
    // The attention mask is a checkpoint input, alive until the backward (eager: additive in the model's dtype;
    // the CPU's SDPA: bool); with RoPE, the position ids and a scalar.
    C extras = f.extras;
    if (t.attention == AttentionKind::Eager) extras += x.b * x.s * x.s * x.r;
    if (t.attention == AttentionKind::Sdpa && x.cpu) extras += x.b * x.s * x.s;
    if (!m.learned_positions) extras += x.s * 8 + 4;
    f.extras = extras.get();
  }
};

}  // namespace

const SetupFeature& checkpointing_feature() {
  static const CheckpointingFeature feature;
  return feature;
}

}  // namespace gpuops::estimator
