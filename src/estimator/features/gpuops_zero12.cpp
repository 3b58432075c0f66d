// gpuops' ZeroOptimizer at stages 1 and 2 (TrainingSetup::zero_reduce_at_step, zero_bucket_bytes): the flat
// gradient reduce-scattered at the step, or in buckets from gradient hooks while the backward runs, with its
// fp32 gradient shard. (DeepSpeed's and Megatron's stages 1-2 are the core's flat layout: no unit.)
#include <algorithm>

#include "gpuops/errors.h"
#include "gpuops/estimator/estimate.h"
#include "gpuops/estimator/param_tensors.h"
#include "gpuops/estimator/state_layout.h"
#include "gpuops/estimator/step_phases.h"
#include "setup_feature.h"

namespace gpuops::estimator {
namespace {

using C = CheckedInt;

// A 16-bit bucket is reduced in fp32 chunks of kZeroReduceChunk elements per rank, two in flight, one bucket at
// a time: each chunk an fp32 copy of N ranks' chunks and, over Gloo (the CPU), its clone.
int64_t fp32_reduce_chunks(const TrainingSetup& s, const DeviceProfile& device, int64_t bucket_elements) {
  if (!runs_in_16_bits(s)) return 0;  // fp32 buckets are reduce-scattered as they are
  const int64_t chunks = std::min(bucket_elements, (C(2) * s.num_gpus * kZeroReduceChunk).get());
  return (C(chunks) * 4 * (device.is_cpu() ? 2 : 1)).get();
}

// Reducing in the backward: buckets are cut in backward order, each up to zero_bucket_bytes unless one parameter
// is larger. Stage 2 allocates a bucket's whole buffer at its first gradient and frees it once reduced; stage 1
// keeps its flat gradient anyway (persistent). At most three consecutive buckets are alive (two reducing, one
// filling): at the last block's backward the untied LM head's bucket and two of the last blocks', at the end the
// embeddings' and two of the first blocks' (bounded by the bucket of the largest such tensor outside the blocks
// and twice that of the largest inside). Every launched bucket has its fp32 reduced shard and, on the CPU, Gloo's
// clone of its input (ProcessGroupGloo reduce-scatters by all-reducing a clone; a 16-bit bucket's fp32 chunks
// instead, see fp32_reduce_chunks). At the end all are launched and the first parameter's own gradient
// (autograd's, copied into its bucket) is still held.
int64_t buckets_in_flight(const StepContext& c, StepPhase phase) {
  const ModelSpec& m = c.model;
  const TrainingSetup& s = c.setup;
  const bool end = phase == StepPhase::BackwardEnd;
  if (s.zero_bucket_bytes == 0) return 0;
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
  if (c.device.is_cpu() && !runs_in_16_bits(s)) bytes += C(launched) * g;       // Gloo's clones
  if (launched > 0) bytes += fp32_reduce_chunks(s, c.device, std::min(total, std::max(outer, block)));
  return bytes.get();
}

class GpuopsZero12Feature final : public SetupFeature {
 public:
  void validate(const TrainingSetup& s, const ModelSpec& m) const override {
    const bool fsdp2 = s.sharding == ShardingLayout::Fsdp2, params_only = m.family == ModelFamily::ParamsOnly;
    GPUOPS_CHECK_ARG(!s.zero_reduce_at_step || ((s.zero_stage == 1 || s.zero_stage == 2) && !fsdp2),
                     "zero-reduce step (gpuops' ZeroOptimizer) applies to ZeRO stages 1 and 2 with sharding flat; "
                     "accepted: zero 1 or 2, or zero-reduce backward; got zero {}{}", s.zero_stage,
                     fsdp2 ? " with sharding fsdp2" : "");
    GPUOPS_CHECK_ARG(s.zero_bucket_bytes >= 0, "zero-bucket-bytes must be >= 0 (0: buckets not counted), got {}",
                     s.zero_bucket_bytes);
    GPUOPS_CHECK_ARG(s.zero_bucket_bytes == 0 || ((s.zero_stage == 1 || s.zero_stage == 2) && !fsdp2 &&
                                                  !s.zero_reduce_at_step && !params_only),
                     "zero-bucket-bytes (gpuops' ZeroOptimizer reducing in the backward) applies to ZeRO stages 1 "
                     "and 2 with sharding flat, zero-reduce backward and an architecture; accepted: 0 otherwise, got "
                     "zero {}, zero-reduce {}{}", s.zero_stage, s.zero_reduce_at_step ? "step" : "backward",
                     params_only ? ", a bare parameter count" : "");
  }
  bool on(const TrainingSetup& s) const override { return s.zero_reduce_at_step || s.zero_bucket_bytes > 0; }
  bool gradients_before_backward() const override { return true; }

  // Reducing at the step: the whole flat gradient lives through the step, with an fp32 shard beside it when
  // stage 2 keeps one or when 16-bit gradients are reduced in fp32. Reducing in the backward: the fp32 shard
  // from construction on; stage 1 keeps the flat gradient too.
  // Offloaded (offload_optimizer: ZeroOptimizer(offload="cpu")), the fp32 gradient shards live on the host:
  // the device keeps only the flat gradient (and, at the step, each bucket's reduced shard until its copy to
  // the host is queued: moments()).
  void persistent(const StepContext& c, MemoryBreakdown& b) const override {
    const TrainingSetup& s = c.setup;
    const int64_t wbytes = trainable_element_bytes(s), local_states = sharded_trainable_elements(c.model, s, 1);
    const C flat = C(trainable_parameter_count(c.model, s)) * wbytes;
    const C shard = s.offload_optimizer ? C(0) : 4 * C(local_states);
    if (s.zero_reduce_at_step) {
      const bool fp32_shard = s.zero_stage == 2 || wbytes != 4;
      b.gradients = (flat + (fp32_shard ? shard : C(0))).get();
    } else {
      b.gradients = ((s.zero_stage == 1 ? flat : C(0)) + shard).get();
    }
  }

  void moments(const StepContext& c, const MomentTerms& t, Moments& moments) const override {
    const ModelSpec& m = c.model;
    const TrainingSetup& s = c.setup;
    const int64_t pb = trainable_element_bytes(s);
    // The first gradient (the LM head's; the final norm's under a tied head) allocates the first bucket whole
    // right after the loss. That moment holds the loss moment's activations, the head's weight and input
    // gradients and the bucket, and can pass the logit gradients'.
    MemoryBreakdown& loss = moment(moments, StepPhase::LossBackward);
    if (s.zero_bucket_bytes > 0 && has_lm_head(m)) {
      MemoryBreakdown head = loss;
      head.logits = 0;
      head.gradients = (C(t.gradients_so_far) + t.head_gradient).get();
      head.temporaries =
          (C(t.hidden_gradient) + t.backward_extras + buckets_in_flight(c, StepPhase::AttentionBackward)).get();
      if (head.total() > loss.total()) loss = head;
    }
    MemoryBreakdown& attn = moment(moments, StepPhase::AttentionBackward);
    attn.temporaries = (C(attn.temporaries) + buckets_in_flight(c, StepPhase::AttentionBackward)).get();
    // A tied gradient's sum comes before the last reductions (the buckets hold that sum as the last gradient).
    MemoryBreakdown& end = moment(moments, StepPhase::BackwardEnd);
    end.temporaries = std::max(end.temporaries, buckets_in_flight(c, StepPhase::BackwardEnd));

    // Over Gloo (the CPU), after the step every bucket's all-gather gathers into a flat copy of it; reducing at
    // the step, every bucket's reduce-scatter first all-reduced a clone of it, which Gloo's worker thread may
    // still hold when the all-gathers start (measured: now and then both, 2 x the gradient's bytes, on
    // llama-gqa-untied's stage 1; stage 2 has freed its flat gradient by then).
    MemoryBreakdown& step = moment(moments, StepPhase::OptimizerStep);
    // Offloaded, reducing at the step: every bucket's fp32 reduced shard (stage 2, or 16-bit gradients) is
    // launched before the first is copied to the host (stage 1 float32 reduces in place).
    if (s.offload_optimizer && s.zero_reduce_at_step && (s.zero_stage == 2 || pb != 4))
      step.gradients = (C(step.gradients) + 4 * C(sharded_trainable_elements(m, s, 1))).get();
    if (c.device.is_cpu() && s.num_gpus > 1) {
      const bool clones_linger = s.zero_reduce_at_step && s.zero_stage == 1 && !runs_in_16_bits(s);
      const C copies = C(trainable_parameter_count(m, s)) * pb * (clones_linger ? 2 : 1);
      step.temporaries = std::max(step.temporaries, copies.get());
    }
    // Reducing at the step, a 16-bit bucket's fp32 chunks come before the step (buckets up to 25 MiB, the
    // default; bounded by the model).
    if (s.zero_reduce_at_step && s.num_gpus > 1) {
      const int64_t bucket = std::min(trainable_parameter_count(m, s), ceil_div(int64_t{25} << 20, pb));
      step.temporaries = std::max(step.temporaries, fp32_reduce_chunks(s, c.device, bucket));
    }
  }
};

}  // namespace

const SetupFeature& gpuops_zero12_feature() {
  static const GpuopsZero12Feature feature;
  return feature;
}

}  // namespace gpuops::estimator
