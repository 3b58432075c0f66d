// The peak of a training step is one of four moments (FINDINGS.md, "where the peak is"); each is
// written here as the sum of what is alive at that moment.
#include "gpuops/estimator/step_phases.h"

#include <algorithm>

#include "gpuops/estimator/activations.h"
#include "gpuops/estimator/estimate.h"

namespace gpuops::estimator {
namespace {

using C = CheckedInt;  // sizes: overflow throws SizeOverflow (see checked_int.h)

bool has_lm_head(const ModelSpec& m) { return m.family == ModelFamily::Decoder || m.masked_lm_head; }

int64_t trainable_element_bytes(const TrainingSetup& s) { return runs_in_16_bits(s) ? 2 : 4; }

int64_t state_element_bytes(const TrainingSetup& s) { return s.precision == Precision::Bf16Pure ? 2 : 4; }

// Largest trainable tensor: a model parameter, or the widest LoRA adapter matrix.
int64_t largest_trainable_tensor(const ModelSpec& m, const TrainingSetup& s) {
  if (s.lora.rank == 0) return largest_parameter_tensor(m);
  int64_t largest = 0;
  for (const auto& t : s.lora.targets) {
    const LinearShape l = projection_shape(m, t);
    largest = std::max(largest, (C(s.lora.rank) * std::max(l.in_features, l.out_features)).get());
  }
  return largest;
}

// Extra transients of every backward moment: a quantised base weight dequantised for its matmul, and
// ZeRO-3's gathered full weights of the current block plus the prefetched next one.
int64_t backward_extras(const ModelSpec& m, const TrainingSetup& s) {
  if (m.family == ModelFamily::ParamsOnly) return 0;
  C bytes = 0;
  if (s.lora.rank > 0 && (s.lora.base == BaseWeightDtype::Int8 || s.lora.base == BaseWeightDtype::Nf4)) {
    C largest = 0;
    for (const auto& p : projection_names(m)) {
      const LinearShape l = projection_shape(m, p);
      largest = std::max(largest, C(l.in_features) * l.out_features);
    }
    bytes += 2 * largest;
  }
  if (s.zero_stage >= 3 && s.num_gpus > 1) {
    const int64_t weight_bytes = s.lora.rank > 0 ? 2 : trainable_element_bytes(s);
    bytes += 2 * C(parameter_groups(m).per_layer()) * weight_bytes;
  }
  return bytes.get();
}

}  // namespace

int64_t optimizer_step_temporaries(const ModelSpec& m, const TrainingSetup& s, const DeviceProfile& device) {
  if (s.optimizer != OptimizerKind::Adam && s.optimizer != OptimizerKind::AdamW) return 0;  // in place
  OptimizerImpl impl = s.optimizer_impl;
  if (impl == OptimizerImpl::Default) impl = device.is_cpu() ? OptimizerImpl::ForLoop : OptimizerImpl::Foreach;
  const int64_t local = zero_shard(trainable_parameter_count(m, s), s, 1);
  const int64_t bytes = state_element_bytes(s);
  switch (impl) {
    case OptimizerImpl::ForLoop:
      // denom = exp_avg_sq.sqrt() and the update, per parameter. A bare count has no largest tensor:
      // count it as a foreach list (an upper bound).
      if (m.family == ModelFamily::ParamsOnly) return (C(local) * bytes).get();
      return (2 * C(std::min(local, largest_trainable_tensor(m, s))) * bytes).get();
    case OptimizerImpl::Foreach: return (C(local) * bytes).get();  // sqrt(exp_avg_sq) for the whole list at once
    case OptimizerImpl::Fused:
    case OptimizerImpl::Default: return 0;
  }
  return 0;
}

std::vector<MemoryBreakdown> phase_breakdowns(const ModelSpec& m, const TrainingSetup& s, const DeviceProfile& device,
                                              const MemoryBreakdown& persistent) {
  const ForwardSaved f = forward_saved(m, s, device);
  const C tokens = C(s.micro_batch) * s.seq_len, Nh = tokens * m.hidden_size;
  const bool full_ft = s.lora.rank == 0;
  const int64_t pb = trainable_element_bytes(s);
  const int64_t all_grads = persistent.gradients;
  // Gradients are None in the forward and the early backward, unless accumulation keeps them.
  const int64_t grads_so_far = s.grad_accum > 1 ? all_grads : 0;
  const int64_t extras = backward_extras(m, s);

  MemoryBreakdown base = persistent;
  base.gradients = 0;
  std::vector<MemoryBreakdown> phases(4, base);

  // Backward at the loss: log-softmax's backward holds its saved output, the incoming and the produced
  // fp32 logit gradients; the shifted labels are already freed.
  MemoryBreakdown& loss = phases[static_cast<int>(StepPhase::LossBackward)];
  loss.peak_phase = StepPhase::LossBackward;
  loss.gradients = grads_so_far;
  loss.activations = f.total() - f.loss;
  loss.logits = has_lm_head(m) ? (f.loss + 2 * tokens * m.vocab_size * 4 - tokens * 8).get() : 0;
  loss.temporaries = extras;

  // Backward through the last block's attention: the head's tensors are freed, the LM-head gradient and
  // the hidden-state gradient exist; the block's MLP half is freed (or, checkpointed, the block has just
  // been recomputed, attention half included).
  MemoryBreakdown& attn = phases[static_cast<int>(StepPhase::AttentionBackward)];
  attn.peak_phase = StepPhase::AttentionBackward;
  const int64_t head_grad = full_ft && has_lm_head(m) ? (C(m.vocab_size) * m.hidden_size * pb).get() : 0;
  attn.gradients = std::max(grads_so_far, head_grad);
  attn.activations = (C(f.total()) - f.loss - f.final_norm +
                      (f.last_block_checkpointed ? f.block_attention : -f.block_mlp)).get();
  if (m.family == ModelFamily::ParamsOnly) attn.activations = 0;
  attn.temporaries = (Nh * (runs_in_16_bits(s) ? 2 : 4) + attention_backward_bytes(m, s, device) + extras).get();

  // End of the backward: every gradient. A tied embedding gets its second gradient (the embedding
  // backward's dense V x h) accumulated out of place: old, new and sum alive together; under autocast the
  // LM-head gradient arrived through an fp32 copy, leaving one extra.
  MemoryBreakdown& end = phases[static_cast<int>(StepPhase::BackwardEnd)];
  end.peak_phase = StepPhase::BackwardEnd;
  end.gradients = all_grads;
  end.activations = f.inputs;
  const bool autocast = is_mixed(s.precision) && s.amp == AmpLayout::Autocast;
  if (full_ft && m.tied_embeddings && m.family == ModelFamily::Decoder)
    end.temporaries = ((autocast ? 1 : 2) * C(m.vocab_size) * m.hidden_size * pb).get();

  // The optimizer step: activations are gone; the optimizer's own temporaries.
  MemoryBreakdown& step = phases[static_cast<int>(StepPhase::OptimizerStep)];
  step.peak_phase = StepPhase::OptimizerStep;
  step.gradients = all_grads;
  step.activations = f.inputs;
  step.temporaries = optimizer_step_temporaries(m, s, device);
  return phases;
}

}  // namespace gpuops::estimator
