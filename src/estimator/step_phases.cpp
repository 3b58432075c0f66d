// The peak of a training step is one of four moments (FINDINGS.md, "where the peak is"); each is
// written here as the sum of what is alive at that moment.
#include "gpuops/estimator/step_phases.h"

#include <algorithm>

#include "gpuops/estimator/activations.h"
#include "gpuops/estimator/estimate.h"
#include "gpuops/estimator/param_tensors.h"
#include "gpuops/estimator/state_layout.h"
#include "features/setup_feature.h"

namespace gpuops::estimator {
namespace {

using C = CheckedInt;  // sizes: overflow throws SizeOverflow (see checked_int.h)

int64_t state_element_bytes(const TrainingSetup& s) { return s.precision == Precision::Bf16Pure ? 2 : 4; }

// Largest trainable tensor: a model parameter, or a feature's (the widest LoRA adapter matrix).
int64_t largest_trainable_tensor(const ModelSpec& m, const TrainingSetup& s) {
  const auto own = feature_trainable_tensors(m, s);
  if (!own) return largest_parameter_tensor(m);
  int64_t largest = 0;
  for (const ParamTensor& t : *own) largest = std::max(largest, t.elements());
  return largest;
}

// Transients of every backward moment, from the features (a quantised base's dequantised weight). ZeRO-3's /
// FSDP2's unsharded weights: unsharded_bytes.
int64_t backward_extras(const ModelSpec& m, const TrainingSetup& s) {
  C bytes = 0;
  for (const SetupFeature* f : features_of(s)) bytes += f->backward_transients(m, s);
  return bytes.get();
}

// The head's bytes at the loss moment (`saved`: the loss's saved bytes, ForwardSaved::loss): log-softmax's
// backward holds its saved output, the incoming and the produced fp32 logit gradients; the shifted labels are
// freed. A loss feature (features/) may say its own.
int64_t loss_moment_bytes(const ModelSpec& m, const TrainingSetup& s, const DeviceProfile& device, int64_t saved) {
  std::optional<int64_t> own;
  const StepContext context{m, s, device};
  for (const SetupFeature* f : features_of(s))
    if (const auto bytes = f->loss_moment(context, saved)) own = bytes;
  if (own) return *own;
  const C N = C(s.micro_batch) * s.seq_len;
  return (C(saved) + 2 * N * m.vocab_size * loss_logit_bytes(s) - N * 8).get();
}

}  // namespace

int64_t optimizer_step_temporaries(const ModelSpec& m, const TrainingSetup& s, const DeviceProfile& device) {
  // Adafactor, paged and offloaded optimizers decide their own (a later feature's answer replaces an earlier one's).
  std::optional<int64_t> own;
  const StepContext context{m, s, device};
  for (const SetupFeature* f : features_of(s))
    if (const auto bytes = f->step_temporaries(context)) own = bytes;
  if (own) return *own;
  if (s.optimizer != OptimizerKind::Adam && s.optimizer != OptimizerKind::AdamW) return 0;  // in place
  OptimizerImpl impl = s.optimizer_impl;
  if (impl == OptimizerImpl::Default) impl = device.is_cpu() ? OptimizerImpl::ForLoop : OptimizerImpl::Foreach;
  const int64_t local = sharded_trainable_elements(m, s, 1);
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
  const int64_t pb = trainable_element_bytes(s);
  const int64_t all_grads = persistent.gradients;
  // Gradients are None in the forward and the early backward, unless accumulation keeps them.
  const bool model_trained = !model_frozen(s);  // LoRA freezes it
  const MomentTerms terms{f, gradients_alive_in_forward(s) ? all_grads : 0,
                          model_trained && has_lm_head(m) ? (C(m.vocab_size) * m.hidden_size * pb).get() : 0,
                          backward_extras(m, s), (Nh * pb).get()};

  MemoryBreakdown base = persistent;
  base.gradients = 0;
  Moments phases(4, base);

  // Backward at the loss: log-softmax's backward holds its saved output, the incoming and the produced
  // fp32 logit gradients; the shifted labels are already freed.
  MemoryBreakdown& loss = moment(phases, StepPhase::LossBackward);
  loss.peak_phase = StepPhase::LossBackward;
  loss.gradients = terms.gradients_so_far;
  loss.activations = f.total() - f.loss;
  loss.logits = has_lm_head(m) ? loss_moment_bytes(m, s, device, f.loss) : 0;
  loss.temporaries = (C(terms.backward_extras) + unsharded_bytes(m, s, StepPhase::LossBackward)).get();

  // Backward through the last block's attention: the head's tensors are freed, the LM-head gradient and
  // the hidden-state gradient exist; the block's MLP half is freed. Checkpointed, the block has just been
  // recomputed: its backward begins with the MLP half while both halves are alive, so the moment is the larger
  // of that start (the MLP's tensors and input gradients) and the attention's backward.
  MemoryBreakdown& attn = moment(phases, StepPhase::AttentionBackward);
  attn.peak_phase = StepPhase::AttentionBackward;
  attn.gradients = std::max(terms.gradients_so_far, terms.head_gradient);
  const int64_t attention_grads = attention_backward_bytes(m, s, device);
  // What the MLP backward starts with beyond the attention half: the MLP's tensors and the rest of the block.
  const int64_t mlp_half = (C(f.block_mlp) + f.block_other).get();
  const int64_t mlp_start = f.last_block_checkpointed ? (C(mlp_half) + mlp_backward_bytes(m, s, device)).get() : 0;
  attn.activations = (C(f.total()) - f.loss - f.final_norm +
                      (f.last_block_checkpointed ? f.block_attention - f.last_block_cache : -f.block_mlp) +
                      (mlp_start > attention_grads ? mlp_half : 0)).get();
  if (m.family == ModelFamily::ParamsOnly) attn.activations = 0;
  attn.temporaries = (C(terms.hidden_gradient) +
                      (mlp_start > attention_grads ? mlp_start - mlp_half : attention_grads) +
                      terms.backward_extras + unsharded_bytes(m, s, StepPhase::AttentionBackward)).get();

  // End of the backward: every gradient. A tied embedding gets its second gradient (the embedding
  // backward's dense V x h) accumulated out of place: old, new and sum alive together; under autocast the
  // LM-head gradient arrived through an fp32 copy, leaving one extra.
  MemoryBreakdown& end = moment(phases, StepPhase::BackwardEnd);
  end.peak_phase = StepPhase::BackwardEnd;
  end.gradients = all_grads;
  end.activations = f.inputs;
  const bool autocast = is_mixed(s.precision) && s.amp == AmpLayout::Autocast;
  if (model_trained && m.tied_embeddings && m.family == ModelFamily::Decoder)
    end.temporaries = ((autocast ? 1 : 2) * C(m.vocab_size) * m.hidden_size * pb).get();
  end.temporaries = (C(end.temporaries) + unsharded_bytes(m, s, StepPhase::BackwardEnd)).get();  // FSDP2's root

  // The optimizer step: activations are gone; the optimizer's own temporaries.
  MemoryBreakdown& step = moment(phases, StepPhase::OptimizerStep);
  step.peak_phase = StepPhase::OptimizerStep;
  step.gradients = all_grads;
  step.activations = f.inputs;
  step.temporaries = optimizer_step_temporaries(m, s, device);

  const StepContext context{m, s, device};
  for (const SetupFeature* feature : features_of(s)) feature->moments(context, terms, phases);
  return phases;
}

}  // namespace gpuops::estimator
