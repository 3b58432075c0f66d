#pragma once
// What the forward's ops save, op by op, for one micro-batch: the sizes the terms are written in (Shape) and
// the model of the ops (ForwardOps). activations.cpp holds the eager model of the Hugging Face code; a setup
// feature that changes what the ops save (compile's partition, LoRA's frozen base) wraps it with its own.
// Private to src/estimator.

#include <cstdint>

#include "gpuops/estimator/checked_int.h"
#include "gpuops/estimator/device_profile.h"
#include "gpuops/estimator/model_spec.h"
#include "gpuops/estimator/training_setup.h"

namespace gpuops::estimator {

/// How a block's tensors are typed: all fp32, autocast (fp32 residual stream, 16-bit matmuls), or 16-bit.
enum class Numerics { Fp32, Autocast, Half };

/// Every size is a CheckedInt: products of batch, sequence and model sizes throw SizeOverflow instead of
/// wrapping (estimate_memory names the argument).
struct Shape {
  Numerics mode;
  CheckedInt N, h, V, i, L;  // tokens, hidden, vocab, MLP width, layers
  CheckedInt b, s, a, d;     // batch, sequence, heads, head width
  CheckedInt e;              // compute dtype bytes (matmul outputs)
  CheckedInt r;              // residual-stream / norm-input dtype bytes
  CheckedInt mask;           // dropout mask bytes: the input dtype on the CPU, 1-byte bool on CUDA
  bool cpu;
  bool amp;  // autocast is on (mixed precision, AmpLayout::Autocast)
  CheckedInt Nq() const { return N * a * d; }          // q (and k, v after GQA expansion) elements
  CheckedInt scores() const { return b * a * s * s; }  // one attention matrix for all heads
};

Shape shape_of(const ModelSpec& model, const TrainingSetup& setup, const DeviceProfile& device);

/// Saved bytes op by op. The defaults are the eager model of the Hugging Face code (activations.cpp); each
/// term is for one micro-batch.
class ForwardOps {
 public:
  virtual ~ForwardOps() = default;
  /// A norm's saved tensors; `consumers` linears read its output (each casts it to 16 bits under autocast).
  virtual CheckedInt norm(const ModelSpec&, const Shape&, int64_t consumers) const;
  /// One block's attention half, fully saved (what recomputation rebuilds).
  virtual CheckedInt attention(const ModelSpec&, const TrainingSetup&, const Shape&) const;
  /// One block's dense MLP half.
  virtual CheckedInt mlp(const ModelSpec&, const Shape&) const;
  /// The rest of a block: its norms and residual dropout masks.
  virtual CheckedInt block_other(const ModelSpec&, const TrainingSetup&, const Shape&) const;
  /// What the first block does not save when no block is checkpointed (its input needs no gradient).
  virtual CheckedInt first_block_unsaved(const ModelSpec&, const TrainingSetup&, const Shape&) const;
  /// RoPE's cos and sin tables.
  virtual CheckedInt rope_tables(const Shape&) const;
  /// Saved once for every block that is not checkpointed (a compiled graph's shared CPU attention mask).
  virtual CheckedInt shared_by_blocks(const TrainingSetup&, const Shape&, int64_t checkpointed) const;
  /// Autocast's cached 16-bit copies of the weights it casts with grad enabled: the head's and those of
  /// `layers` blocks (checkpointed blocks run their forward without grad).
  virtual CheckedInt autocast_copies(const ModelSpec&, const TrainingSetup&, const Shape&, int64_t layers) const;
  /// Outside the blocks, beyond the positions, masks and copies above (LoRA's outer adapters).
  virtual CheckedInt outer_extras(const ModelSpec&, const TrainingSetup&, const Shape&) const;
  /// A decoder's final norm.
  virtual CheckedInt final_norm(const ModelSpec&, const Shape&) const;
  /// The loss's saved bytes (Hugging Face's cross-entropy), before a soft cap: the log-softmax of the logits in
  /// `logit_bytes` (4 upcast, else the compute dtype's), the labels and the loss.
  virtual CheckedInt loss(const Shape&, int64_t logit_bytes) const;
};

/// The eager model.
const ForwardOps& eager_ops();

/// A model that answers as `inner` does except where a derived class overrides.
class WrappedOps : public ForwardOps {
 public:
  explicit WrappedOps(const ForwardOps& inner) : inner_(inner) {}
  CheckedInt norm(const ModelSpec& m, const Shape& x, int64_t consumers) const override {
    return inner_.norm(m, x, consumers);
  }
  CheckedInt attention(const ModelSpec& m, const TrainingSetup& t, const Shape& x) const override {
    return inner_.attention(m, t, x);
  }
  CheckedInt mlp(const ModelSpec& m, const Shape& x) const override { return inner_.mlp(m, x); }
  CheckedInt block_other(const ModelSpec& m, const TrainingSetup& t, const Shape& x) const override {
    return inner_.block_other(m, t, x);
  }
  CheckedInt first_block_unsaved(const ModelSpec& m, const TrainingSetup& t, const Shape& x) const override {
    return inner_.first_block_unsaved(m, t, x);
  }
  CheckedInt rope_tables(const Shape& x) const override { return inner_.rope_tables(x); }
  CheckedInt shared_by_blocks(const TrainingSetup& t, const Shape& x, int64_t checkpointed) const override {
    return inner_.shared_by_blocks(t, x, checkpointed);
  }
  CheckedInt autocast_copies(const ModelSpec& m, const TrainingSetup& t, const Shape& x,
                             int64_t layers) const override {
    return inner_.autocast_copies(m, t, x, layers);
  }
  CheckedInt outer_extras(const ModelSpec& m, const TrainingSetup& t, const Shape& x) const override {
    return inner_.outer_extras(m, t, x);
  }
  CheckedInt final_norm(const ModelSpec& m, const Shape& x) const override { return inner_.final_norm(m, x); }
  CheckedInt loss(const Shape& x, int64_t logit_bytes) const override { return inner_.loss(x, logit_bytes); }

 protected:
  const ForwardOps& inner_;
};

/// Eager attention's building blocks, for variants: the CPU SDPA's per-block mask and a fused q|k|v view's
/// extra (fused_qkv_extra) can be left out.
CheckedInt attention_bytes(const ModelSpec& m, const TrainingSetup& t, const Shape& x, bool cpu_mask_per_block,
                           bool fused_view);
/// Linears that read the MLP's input norm (each casts it to 16 bits under autocast): gate and up, or one.
int64_t mlp_input_consumers(const ModelSpec& m);

}  // namespace gpuops::estimator
