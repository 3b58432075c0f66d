// The peak of a training step is one of four moments (FINDINGS.md, "where the peak is"); each is
// written here as the sum of what is alive at that moment.
#include "gpuops/estimator/step_phases.h"

#include <algorithm>

#include "gpuops/estimator/activations.h"
#include "gpuops/estimator/estimate.h"
#include "gpuops/estimator/param_tensors.h"
#include "gpuops/estimator/state_layout.h"

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
    const LinearShape l = is_outer_lora_target(t) ? outer_lora_shape(m, t) : projection_shape(m, t);
    largest = std::max(largest, (C(s.lora.rank) * std::max(l.in_features, l.out_features)).get());
  }
  return largest;
}

// Extra transients of every backward moment: a quantised base weight dequantised for its matmul (the LM
// head's with quantize_lm_head). ZeRO-3's / FSDP2's unsharded weights: unsharded_bytes (state_layout.cpp).
int64_t backward_extras(const ModelSpec& m, const TrainingSetup& s) {
  if (m.family == ModelFamily::ParamsOnly) return 0;
  C bytes = 0;
  if (s.lora.rank > 0 && is_quantised_base(s.lora.base)) {
    C largest = s.lora.quantize_lm_head ? C(m.vocab_size) * m.hidden_size : C(0);
    for (const auto& g : block_linears(m))  // experts included
      largest = std::max(largest, C(g.shape.in_features) * g.shape.out_features);
    bytes += 2 * largest;
  }
  return bytes.get();
}

// gpuops' ZeroOptimizer reduces a 16-bit bucket in fp32 chunks of kZeroReduceChunk elements per rank, two in
// flight, one bucket at a time: each chunk an fp32 copy of N ranks' chunks and, over Gloo (the CPU), its clone.
int64_t fp32_reduce_chunks(const TrainingSetup& s, const DeviceProfile& device, int64_t bucket_elements) {
  if (!runs_in_16_bits(s)) return 0;  // fp32 buckets are reduce-scattered as they are
  const int64_t chunks = std::min(bucket_elements, (C(2) * s.num_gpus * kZeroReduceChunk).get());
  return (C(chunks) * 4 * (device.is_cpu() ? 2 : 1)).get();
}

// gpuops' ZeroOptimizer reducing in the backward (TrainingSetup::zero_bucket_bytes): buckets are cut in
// backward order, each up to zero_bucket_bytes unless one parameter is larger. Stage 2 allocates a bucket's
// whole buffer at its first gradient and frees it once reduced; stage 1 keeps its flat gradient anyway
// (persistent). At most three consecutive buckets are alive (two reducing, one filling): at the last block's
// backward the untied LM head's bucket and two of the last blocks', at the end the embeddings' and two of
// the first blocks' (bounded by the bucket of the largest such tensor outside the blocks and twice that of
// the largest inside). Every launched bucket has its fp32 reduced shard and, on the CPU, Gloo's clone of its input
// (ProcessGroupGloo reduce-scatters by all-reducing a clone; a 16-bit bucket's fp32 chunks instead, see
// fp32_reduce_chunks). At the end all are launched and the first parameter's own gradient (autograd's, copied
// into its bucket) is still held.
int64_t buckets_in_flight(const ModelSpec& m, const TrainingSetup& s, const DeviceProfile& device, StepPhase phase) {
  const bool end = phase == StepPhase::BackwardEnd;
  if (s.zero_bucket_bytes == 0 || !(end || phase == StepPhase::AttentionBackward)) return 0;
  const int64_t g = trainable_element_bytes(s), total = trainable_parameter_count(m, s);
  int64_t largest_outer = 0, largest_head = 0, largest_block = 0;
  for (const ParamTensor& t : trainable_tensor_shapes(m, s)) {
    (t.root ? largest_outer : largest_block) = std::max(t.root ? largest_outer : largest_block, t.elements());
    if (t.lm_head) largest_head = std::max(largest_head, t.elements());  // an untied head: the first bucket
  }
  const int64_t cap = std::min(total, ceil_div(s.zero_bucket_bytes, g));  // a bucket past the model is the model
  const int64_t outer = std::max(cap, end ? largest_outer : largest_head), block = std::max(cap, largest_block);
  const int64_t alive = std::min(total, (C(outer) + 2 * C(block)).get());
  const int64_t launched = end ? alive : std::min(std::max<int64_t>(total - block, 0), (C(outer) + block).get());
  C bytes = C(ceil_div(launched, s.num_gpus)) * 4;                                // reduced shards
  if (s.zero_stage == 2) bytes += C(alive) * g;                                   // bucket buffers
  if (s.zero_stage == 2 && end) bytes += C(std::max(largest_outer, largest_block)) * g;  // the last gradient
  if (device.is_cpu() && !runs_in_16_bits(s)) bytes += C(launched) * g;         // Gloo's clones
  if (launched > 0) bytes += fp32_reduce_chunks(s, device, std::min(total, std::max(outer, block)));
  return bytes.get();
}

// The head's bytes at the loss moment (`saved`: the loss's saved bytes, ForwardSaved::loss).
// Standard: log-softmax's backward holds its saved output, the incoming and the produced fp32 logit
// gradients; the shifted labels are freed. Chunked (torchtune's CEWithChunkedOutputLoss, eager): the larger
// of the end of the loss's forward (every chunk's logits in the compute dtype still held by the caller, the
// last chunk's fp32 upcast) and the first chunk's backward (two fp32 gradients of one chunk). Fused linear
// CE (Liger): its gradients are made in the forward; the transient is one chunk of logits, chunk =
// next_pow2(ceil(N / ceil(V / h))) tokens, in the compute dtype. Compiled chunked loss (torchtune compiles
// each chunk's loss): the saved compute-dtype logits, then one chunk's gradient.
int64_t loss_moment_bytes(const ModelSpec& m, const TrainingSetup& s, int64_t saved) {
  const C N = C(s.micro_batch) * s.seq_len, V = m.vocab_size;
  const int64_t e = compute_dtype_bytes(s.precision);
  switch (s.loss) {
    case LossKind::Standard: return (C(saved) + 2 * N * V * 4 - N * 8).get();
    case LossKind::Chunked: {
      const C chunk = ceil_div(N.get(), s.loss_chunks);
      // Compiled: the saved logits are all there is; a chunk's backward makes its gradient in the compute dtype.
      if (s.compile) return (C(saved) + chunk * V * e).get();
      const C backward = C(saved) - N * 8 + 2 * chunk * V * 4;
      const C forward = C(saved) + N * V * e + (e == 4 ? C(0) : chunk * V * 4);
      return std::max(backward.get(), forward.get());
    }
    case LossKind::FusedLinearCe: {
      const int64_t per_chunk_growth = ceil_div(m.vocab_size, m.hidden_size);
      int64_t chunk = 1;
      while (chunk < ceil_div(N.get(), per_chunk_growth)) chunk *= 2;
      return (C(saved) + C(std::min(chunk, N.get())) * V * e).get();
    }
  }
  return saved;
}

}  // namespace

// Alive at every moment of the step: the loop's variable is replaced only by the next forward's output.
int64_t held_logits_bytes(const ModelSpec& m, const TrainingSetup& s) {
  if (s.held_logits == HeldLogits::None || !has_lm_head(m)) return 0;
  const int64_t e = s.held_logits == HeldLogits::Fp32 ? 4 : compute_dtype_bytes(s.precision);
  return (C(s.micro_batch) * s.seq_len * m.vocab_size * e).get();
}

int64_t optimizer_step_temporaries(const ModelSpec& m, const TrainingSetup& s, const DeviceProfile& device) {
  if (const auto own = state_step_temporaries(m, s, device)) return *own;  // Adafactor, paged, offloaded
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
  const bool full_ft = s.lora.rank == 0;
  const int64_t pb = trainable_element_bytes(s);
  const int64_t all_grads = persistent.gradients;
  // Gradients are None in the forward and the early backward, unless accumulation keeps them.
  const int64_t grads_so_far = gradients_alive_in_forward(s) ? all_grads : 0;
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
  loss.logits = has_lm_head(m) ? loss_moment_bytes(m, s, f.loss) : 0;
  loss.temporaries = extras;
  loss.temporaries = (C(loss.temporaries) + unsharded_bytes(m, s, StepPhase::LossBackward)).get();  // ZeRO-3/FSDP2
  // (gpuops' stage 3 holds the head's gradient in unit 0's buffer: unsharded_bytes)
  const int64_t head_grad = full_ft && has_lm_head(m) && s.sharding != ShardingLayout::Gpuops
                                ? (C(m.vocab_size) * m.hidden_size * pb).get()
                                : 0;
  // gpuops' ZeroOptimizer reducing in the backward: the first gradient (the LM head's; the final norm's under
  // a tied head) allocates the first bucket whole right after the loss. That moment holds the loss moment's
  // activations, the head's weight and input gradients and the bucket, and can pass the logit gradients'.
  if (s.zero_bucket_bytes > 0 && has_lm_head(m)) {
    MemoryBreakdown head = loss;
    head.logits = 0;
    head.gradients = (C(grads_so_far) + head_grad).get();
    head.temporaries = (Nh * pb + extras + buckets_in_flight(m, s, device, StepPhase::AttentionBackward)).get();
    if (head.total() > loss.total()) loss = head;
  }

  if (s.sharding == ShardingLayout::Gpuops && has_lm_head(m)) {  // gpuops' stage 3: unit 0's gradient buffer
    MemoryBreakdown head = loss;
    head.logits = 0;
    head.temporaries = (Nh * pb + extras + gpuops_head_bytes(m, s)).get();
    if (head.total() > loss.total()) loss = head;
  }

  // Backward through the last block's attention: the head's tensors are freed, the LM-head gradient and
  // the hidden-state gradient exist; the block's MLP half is freed (or, checkpointed, the block has just
  // been recomputed, attention half included).
  MemoryBreakdown& attn = phases[static_cast<int>(StepPhase::AttentionBackward)];
  attn.peak_phase = StepPhase::AttentionBackward;
  attn.gradients = std::max(grads_so_far, head_grad);
  attn.activations = (C(f.total()) - f.loss - f.final_norm +
                      (f.last_block_checkpointed ? f.block_attention - f.last_block_cache : -f.block_mlp)).get();
  if (m.family == ModelFamily::ParamsOnly) attn.activations = 0;
  attn.temporaries = (Nh * (runs_in_16_bits(s) ? 2 : 4) + attention_backward_bytes(m, s, device) + extras).get();
  attn.temporaries = (C(attn.temporaries) + unsharded_bytes(m, s, StepPhase::AttentionBackward) +
                      buckets_in_flight(m, s, device, StepPhase::AttentionBackward)).get();

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
  // The tied gradient's sum comes before the last reductions (buckets_in_flight hold that sum as the last gradient).
  end.temporaries = std::max(end.temporaries, buckets_in_flight(m, s, device, StepPhase::BackwardEnd));
  end.temporaries = (C(end.temporaries) + unsharded_bytes(m, s, StepPhase::BackwardEnd)).get();  // FSDP2's root

  // The optimizer step: activations are gone; the optimizer's own temporaries.
  MemoryBreakdown& step = phases[static_cast<int>(StepPhase::OptimizerStep)];
  step.peak_phase = StepPhase::OptimizerStep;
  step.gradients = s.offload_optimizer ? 0 : all_grads;  // offloaded: copied to the host during the backward
  step.activations = f.inputs;
  step.temporaries = optimizer_step_temporaries(m, s, device);
  // gpuops' ZeroOptimizer over Gloo (the CPU): after the step every bucket's all-gather gathers into a flat
  // copy of it; reducing at the step, every bucket's reduce-scatter first all-reduced a clone of it, which
  // Gloo's worker thread may still hold when the all-gathers start (measured: now and then both, 2 x the
  // gradient's bytes, on llama-gqa-untied's stage 1; stage 2 has freed its flat gradient by then).
  if (device.is_cpu() && s.num_gpus > 1 && (s.zero_reduce_at_step || s.zero_bucket_bytes > 0)) {
    const bool clones_linger = s.zero_reduce_at_step && s.zero_stage == 1 && !runs_in_16_bits(s);
    const C copies = C(trainable_parameter_count(m, s)) * pb * (clones_linger ? 2 : 1);
    step.temporaries = std::max(step.temporaries, copies.get());
  }
  // Reducing at the step, a 16-bit bucket's fp32 chunks come before the step (buckets up to 25 MiB, the
  // default; bounded by the model).
  if (s.zero_reduce_at_step && s.num_gpus > 1) {
    const int64_t bucket = std::min(trainable_parameter_count(m, s), ceil_div(int64_t{25} << 20, pb));
    step.temporaries = std::max(step.temporaries, fp32_reduce_chunks(s, device, bucket));
  }
  for (MemoryBreakdown& p : phases) p.logits = (C(p.logits) + held_logits_bytes(m, s)).get();
  return phases;
}

}  // namespace gpuops::estimator
